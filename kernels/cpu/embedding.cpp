// CpuBackend: embedding lookup and its gradient (row functors in
// kernels/functors/embedding.h). Ids are checked first: an id outside
// [0, V) throws, naming the id, its position and V. The backward pass groups
// the tokens by id with a stable counting sort (O(N + V): never more work than
// the gradient table holds), then runs the same row functor as the GPU, one
// group per run of equal ids, in parallel over runs.
#include "kernels/functors/embedding.h"

#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/row_launch.h"

namespace tessera {
namespace {

// Columns per sweep of the backward functor: two AVX-512 vectors of f32 accumulators.
constexpr int kCpuColumns = 32;

template <typename I>
void check_ids(const I* ids, int64_t tokens, int64_t vocab, std::string_view op) {
  for (int64_t n = 0; n < tokens; ++n)
    TESSERA_CHECK(ids[n] >= 0 && int64_t(ids[n]) < vocab, op, ": id ", int64_t(ids[n]), " at position ", n,
                  " is outside the vocabulary [0, ", vocab, ")");
}

}  // namespace

void CpuBackend::embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out, int64_t vocab_begin,
                                   int64_t vocab_size) {
  const int64_t tokens = ids.numel(), vocab = table.size(0), dim = table.size(1);
  dispatch_index(ids.dtype(), "embedding_forward", [&](auto index_tag) {
    using I = decltype(index_tag);
    check_ids(ids.data<I>(), tokens, vocab_size, "embedding_forward");
    dispatch_float(table.dtype(), "embedding_forward", [&](auto tag) {
      using T = decltype(tag);
      cpu_for_each_row(
          tokens, dim,
          EmbeddingForward<T, I>{ids.data<I>(), table.data<T>(), out.data<T>(), vocab, dim, vocab_begin, vocab_size});
    });
  });
}

void CpuBackend::embedding_backward(const Tensor& ids, const Tensor& grad_out, Tensor& grad_table, int64_t vocab_begin,
                                    int64_t vocab_size) {
  const int64_t tokens = ids.numel(), vocab = grad_table.size(0), dim = grad_table.size(1);
  if (tokens == 0 || dim == 0) return;
  dispatch_index(ids.dtype(), "embedding_backward", [&](auto index_tag) {
    using I = decltype(index_tag);
    const I* id = ids.data<I>();
    check_ids(id, tokens, vocab_size, "embedding_backward");
    // Stable counting sort over the whole vocabulary: start[v] = first sorted position of id v.
    std::vector<int64_t> start(size_t(vocab_size) + 1, 0);
    for (int64_t n = 0; n < tokens; ++n) ++start[size_t(id[n]) + 1];
    for (int64_t v = 0; v < vocab_size; ++v) start[size_t(v) + 1] += start[size_t(v)];
    std::vector<I> sorted_ids(static_cast<size_t>(tokens));
    std::vector<int64_t> order(static_cast<size_t>(tokens));
    for (int64_t n = 0; n < tokens; ++n) {
      const int64_t position = start[size_t(id[n])]++;
      sorted_ids[size_t(position)] = id[n];
      order[size_t(position)] = n;
    }
    dispatch_float(grad_table.dtype(), "embedding_backward", [&](auto tag) {
      using T = decltype(tag);
      cpu_for_each_row(tokens, dim,
                       EmbeddingBackward<T, I, kCpuColumns>{sorted_ids.data(), order.data(), grad_out.data<T>(),
                                                            grad_table.data<T>(), tokens, vocab, dim, vocab_begin});
    });
  });
}

}  // namespace tessera
