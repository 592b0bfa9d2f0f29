// ops:: embedding lookup and its gradient: argument checks, then the device's
// backend. Id values are not checked here (that would read device memory):
// the CPU backend throws on an id outside [0, V); on CUDA such an id gives a
// NaN row in the forward pass and is skipped by the backward pass.
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

// rows [N, D] (any shape with N·D elements whose last dimension is D, e.g. ids.shape + [D]).
void check_rows(std::string_view op, const detail::Arg& arg, int64_t tokens, int64_t dim) {
  detail::check_floating(op, arg);
  TESSERA_CHECK(arg.tensor.numel() == tokens * dim && (tokens == 0 || detail::last_dim(arg.tensor) == dim), op, ": '",
                arg.name, "' has shape ", arg.tensor.shape().to_string(), ", expected [", tokens, ", ", dim,
                "] (one row of the table per id)");
}

void check_table(std::string_view op, const detail::Arg& table) {
  detail::check_floating(op, table);
  detail::check_ndim(op, table, 2);
}

// The vocabulary the ids index: the table's rows unless it is a shard.
int64_t whole_vocabulary(std::string_view op, const Tensor& table, int64_t vocab_begin, int64_t vocab_size) {
  if (vocab_size == 0) {
    TESSERA_CHECK(vocab_begin == 0, op, ": vocab_begin ", vocab_begin, " without a vocab_size");
    return table.size(0);
  }
  TESSERA_CHECK(vocab_begin >= 0 && vocab_begin + table.size(0) <= vocab_size, op, ": the table's ", table.size(0),
                " rows from vocab_begin ", vocab_begin, " do not fit in a vocabulary of ", vocab_size);
  return vocab_size;
}

}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out, int64_t vocab_begin, int64_t vocab_size) {
  constexpr std::string_view op = "embedding_forward";
  detail::check_index(op, {"ids", ids});
  check_table(op, {"table", table});
  check_rows(op, {"out", out}, ids.numel(), table.size(1));
  detail::check_same_dtype(op, {"table", table}, {"out", out});
  detail::check_same_device(op, {{"ids", ids}, {"table", table}, {"out", out}});
  const int64_t total = whole_vocabulary(op, table, vocab_begin, vocab_size);
  backend_for(ids, "embedding_forward").embedding_forward(ids, table, out, vocab_begin, total);
}

void embedding_backward(const Tensor& ids, const Tensor& grad_out, Tensor& grad_table, int64_t vocab_begin,
                        int64_t vocab_size) {
  constexpr std::string_view op = "embedding_backward";
  detail::check_index(op, {"ids", ids});
  check_table(op, {"grad_table", grad_table});
  check_rows(op, {"grad_out", grad_out}, ids.numel(), grad_table.size(1));
  detail::check_same_dtype(op, {"grad_out", grad_out}, {"grad_table", grad_table});
  detail::check_same_device(op, {{"ids", ids}, {"grad_out", grad_out}, {"grad_table", grad_table}});
  TESSERA_CHECK(!grad_out.shares_storage_with(grad_table), op, ": 'grad_out' and 'grad_table' must not share memory");
  const int64_t total = whole_vocabulary(op, grad_table, vocab_begin, vocab_size);
  backend_for(ids, "embedding_backward").embedding_backward(ids, grad_out, grad_table, vocab_begin, total);
}

}  // namespace tessera::ops
