// Embedding: forward is an exact gather; backward (always accumulating,
// deterministic) against central differences of the gather and against a
// direct double sum on a size that runs on several threads, with repeated
// ids, unused rows and a non-zero starting grad_table; i32 and i64 ids; an
// out-of-range id throws on the CPU; GPU bit-exact against the CPU.
#include <gtest/gtest.h>

#include <string>

#include "kernels/ops.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/gradcheck.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

const DType kIndexDtypes[] = {DType::i32, DType::i64};

// out[n, d] = table[ids[n], d].
std::vector<double> gather(const std::vector<double>& ids, const std::vector<double>& table, int64_t dim) {
  std::vector<double> out(ids.size() * size_t(dim));
  for (size_t n = 0; n < ids.size(); ++n)
    for (int64_t d = 0; d < dim; ++d)
      out[n * size_t(dim) + size_t(d)] = table[size_t(ids[n]) * size_t(dim) + size_t(d)];
  return out;
}

// initial[v, d] + Σ_{n: ids[n] = v} grad_out[n, d].
std::vector<double> scatter_add(const std::vector<double>& ids, const std::vector<double>& grad_out, int64_t dim,
                                std::vector<double> initial) {
  for (size_t n = 0; n < ids.size(); ++n)
    for (int64_t d = 0; d < dim; ++d)
      initial[size_t(ids[n]) * size_t(dim) + size_t(d)] += grad_out[n * size_t(dim) + size_t(d)];
  return initial;
}

// The backward sums up to ~N/V gradient rows in f32 before one rounding: f32
// results carry a few ulp of the partial sums (hence the absolute slack);
// bf16/f16 are dominated by the final rounding, as in a forward pass.
Tolerance accumulate_tolerance(DType dtype) {
  return dtype == DType::f32 ? Tolerance{1e-5, 1e-5} : forward_tolerance(dtype);
}

class Embedding : public DtypeTest {};

TEST_P(Embedding, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const int64_t vocab = 101, dim = 67;
  const Shape id_shape{7, 61};  // 427 tokens × 67 columns: several threads' worth
  auto table = random_tensor(ctx, Shape{vocab, dim}, dtype, rng);
  for (const DType index : kIndexDtypes) {
    SCOPED_TRACE(std::string("ids ") + std::string(dtype_name(index)));
    auto ids = random_indices(ctx, id_shape, index, rng, 0, vocab);
    Tensor out = poisoned(ctx, Shape{id_shape.numel(), dim}, dtype);
    ops::embedding_forward(ids.tensor, table.tensor, out);
    EXPECT_TRUE(all_close(out, gather(ids.values, table.values, dim), {0, 0}));
    // out may also be shaped ids.shape + [D].
    Tensor out3 = poisoned(ctx, Shape{7, 61, dim}, dtype);
    ops::embedding_forward(ids.tensor, table.tensor, out3);
    EXPECT_TRUE(all_close(out3, gather(ids.values, table.values, dim), {0, 0}));
  }
}

TEST_P(Embedding, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const DType index : kIndexDtypes) {
    SCOPED_TRACE(std::string("ids ") + std::string(dtype_name(index)));
    {
      // Small: against the numerical gradient of the gather with respect to the
      // table. 183 tokens over 23 ids: every id repeats; the grad_table starts non-zero.
      const int64_t vocab = 23, dim = 19;
      auto ids = random_indices(ctx, Shape{3, 61}, index, rng, 0, vocab);
      auto table = random_tensor(ctx, Shape{vocab, dim}, dtype, rng);
      auto grad_out = random_tensor(ctx, Shape{183, dim}, dtype, rng);
      auto grad_table = random_tensor(ctx, Shape{vocab, dim}, dtype, rng);
      ops::embedding_backward(ids.tensor, grad_out.tensor, grad_table.tensor);
      const auto f = [&](const Inputs& in) { return gather(ids.values, in[0], dim); };
      auto expected = numeric_gradient(f, Inputs{table.values}, 0, grad_out.values);
      for (size_t i = 0; i < expected.size(); ++i) expected[i] += grad_table.values[i];
      EXPECT_TRUE(all_close(grad_table.tensor, expected, accumulate_tolerance(dtype)));
    }
    {
      // Larger, on several threads: 1179 tokens over 301 ids (some unused, whose
      // rows must stay as they were), 45 columns (not a multiple of the column block).
      const int64_t vocab = 301, dim = 45;
      auto ids = random_indices(ctx, Shape{9, 131}, index, rng, 0, vocab);
      auto grad_out = random_tensor(ctx, Shape{9, 131, dim}, dtype, rng);
      auto grad_table = random_tensor(ctx, Shape{vocab, dim}, dtype, rng);
      ops::embedding_backward(ids.tensor, grad_out.tensor, grad_table.tensor);
      EXPECT_TRUE(all_close(grad_table.tensor, scatter_add(ids.values, grad_out.values, dim, grad_table.values),
                            accumulate_tolerance(dtype)));
      // Deterministic: the same inputs give the same bits.
      Tensor first = ctx.from_doubles(Shape{vocab, dim}, dtype, grad_table.values);
      Tensor second = ctx.from_doubles(Shape{vocab, dim}, dtype, grad_table.values);
      ops::embedding_backward(ids.tensor, grad_out.tensor, first);
      ops::embedding_backward(ids.tensor, grad_out.tensor, second);
      EXPECT_TRUE(all_close(first, second, {0, 0}));
    }
  }
}

// Vocabulary-parallel: the table split into uneven row shards; each shard's
// forward gives its ids' rows and zeros for the others, so the sum over the
// shards is the whole lookup; each shard's backward adds exactly the rows it
// holds (against the double scatter-add of the whole table).
TEST_P(Embedding, ShardsSumToTheWholeLookup) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  const int64_t vocab = 53, dim = 19, tokens = 211;
  const int64_t bounds[] = {0, 17, 30, 53};  // three shards of 17, 13 and 23 rows
  auto table = random_tensor(ctx, Shape{vocab, dim}, dtype, rng);
  auto grad_out = random_tensor(ctx, Shape{tokens, dim}, dtype, rng);
  for (const DType index : kIndexDtypes) {
    SCOPED_TRACE(std::string("ids ") + std::string(dtype_name(index)));
    auto ids = random_indices(ctx, Shape{tokens}, index, rng, 0, vocab);
    const std::vector<double> whole = gather(ids.values, table.values, dim);
    const std::vector<double> whole_grad =
        scatter_add(ids.values, round_to(dtype, grad_out.values), dim, std::vector<double>(size_t(vocab * dim), 0.0));
    std::vector<double> sum(whole.size(), 0.0);
    for (int s = 0; s < 3; ++s) {
      const int64_t begin = bounds[s], rows = bounds[s + 1] - bounds[s];
      SCOPED_TRACE("shard [" + std::to_string(begin) + ", " + std::to_string(begin + rows) + ")");
      Tensor shard = table.tensor.slice(begin, begin + rows).clone();
      Tensor out = poisoned(ctx, Shape{tokens, dim}, dtype);
      ops::embedding_forward(ids.tensor, shard, out, begin, vocab);
      const std::vector<double> got = out.to_doubles();
      for (int64_t n = 0; n < tokens; ++n) {
        const bool mine = ids.values[size_t(n)] >= double(begin) && ids.values[size_t(n)] < double(begin + rows);
        for (int64_t d = 0; d < dim; ++d) {
          const size_t i = size_t(n * dim + d);
          if (!mine) {
            EXPECT_EQ(got[i], 0.0) << "token " << n << " is held by another shard";
          }
          sum[i] += got[i];
        }
      }
      Tensor grad_shard = ctx.zeros(Shape{rows, dim}, dtype);
      ops::embedding_backward(ids.tensor, grad_out.tensor, grad_shard, begin, vocab);
      const std::vector<double> expected(whole_grad.begin() + begin * dim, whole_grad.begin() + (begin + rows) * dim);
      EXPECT_TRUE(all_close(grad_shard, round_to(dtype, expected), accumulate_tolerance(dtype))) << "backward";
    }
    EXPECT_TRUE(all_close(sum, whole, {0, 0})) << "sum of the shards";
    // An id outside the whole vocabulary is still an error, whichever shard looks it up.
    Tensor bad = ctx.from_doubles(Shape{2}, index, std::vector<double>{3, double(vocab)});
    Tensor out = poisoned(ctx, Shape{2, dim}, dtype);
    Tensor shard = table.tensor.slice(0, 17).clone();
    EXPECT_THROW(ops::embedding_forward(bad, shard, out, 0, vocab), Error);
  }
}

TEST_P(Embedding, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  const int64_t vocab = 301, dim = 45;
  auto table = random_tensor(ctx, Shape{vocab, dim}, dtype, rng);
  auto grad_out = random_tensor(ctx, Shape{1179, dim}, dtype, rng);
  auto grad_table = random_tensor(ctx, Shape{vocab, dim}, dtype, rng);
  for (const DType index : kIndexDtypes) {
    SCOPED_TRACE(std::string("ids ") + std::string(dtype_name(index)));
    auto ids = random_indices(ctx, Shape{9, 131}, index, rng, 0, vocab);
    Tensor out_cpu = poisoned(ctx, Shape{1179, dim}, dtype), out_gpu = poisoned(ctx, Shape{1179, dim}, dtype, gpu);
    ops::embedding_forward(ids.tensor, table.tensor, out_cpu);
    ops::embedding_forward(ids.tensor.to(gpu), table.tensor.to(gpu), out_gpu);
    EXPECT_TRUE(all_close(out_gpu, out_cpu, {0, 0})) << "forward";
    // Both backends add each id's rows in token order in f32 and round once: the same bits.
    Tensor gt_cpu = grad_table.tensor.clone(), gt_gpu = grad_table.tensor.to(gpu);
    ops::embedding_backward(ids.tensor, grad_out.tensor, gt_cpu);
    ops::embedding_backward(ids.tensor.to(gpu), grad_out.tensor.to(gpu), gt_gpu);
    EXPECT_TRUE(all_close(gt_gpu, gt_cpu, {0, 0})) << "backward";
    // A vocabulary shard (rows [100, 200)): zeros for the other ids on both.
    Tensor shard = table.tensor.slice(100, 200).clone();
    ops::embedding_forward(ids.tensor, shard, out_cpu, 100, vocab);
    ops::embedding_forward(ids.tensor.to(gpu), shard.to(gpu), out_gpu, 100, vocab);
    EXPECT_TRUE(all_close(out_gpu, out_cpu, {0, 0})) << "sharded forward";
    Tensor st_cpu = shard.clone(), st_gpu = shard.to(gpu);
    ops::embedding_backward(ids.tensor, grad_out.tensor, st_cpu, 100, vocab);
    ops::embedding_backward(ids.tensor.to(gpu), grad_out.tensor.to(gpu), st_gpu, 100, vocab);
    EXPECT_TRUE(all_close(st_gpu, st_cpu, {0, 0})) << "sharded backward";
  }
}

INSTANTIATE_FLOAT_DTYPES(Embedding);

TEST(EmbeddingArguments, OutOfRangeIdThrowsOnCpu) {
  Context ctx;
  Tensor table = ctx.zeros(Shape{10, 4}, DType::f32);
  Tensor out = ctx.zeros(Shape{3, 4}, DType::f32);
  Tensor grad_table = ctx.zeros(Shape{10, 4}, DType::f32);
  for (const DType index : kIndexDtypes) {
    for (const double bad : {10.0, -1.0}) {
      Tensor ids = ctx.from_doubles(Shape{3}, index, std::vector<double>{2, bad, 5});
      try {
        ops::embedding_forward(ids, table, out);
        ADD_FAILURE() << "no error for id " << bad;
      } catch (const Error& error) {
        const std::string message = error.what();
        EXPECT_NE(message.find("id " + std::to_string(int64_t(bad))), std::string::npos) << message;
        EXPECT_NE(message.find("[0, 10)"), std::string::npos) << message;
      }
      EXPECT_THROW(ops::embedding_backward(ids, out, grad_table), Error);
    }
  }
}

TEST(EmbeddingArguments, RejectsBadArguments) {
  Context ctx;
  Tensor ids = ctx.zeros(Shape{3}, DType::i64);
  Tensor table = ctx.zeros(Shape{10, 4}, DType::f32);
  Tensor out = ctx.zeros(Shape{3, 4}, DType::f32);
  Tensor float_ids = ctx.zeros(Shape{3}, DType::f32);
  EXPECT_THROW(ops::embedding_forward(float_ids, table, out), Error);
  Tensor flat_table = ctx.zeros(Shape{40}, DType::f32);
  EXPECT_THROW(ops::embedding_forward(ids, flat_table, out), Error);
  Tensor wrong_rows = ctx.zeros(Shape{4, 4}, DType::f32);
  EXPECT_THROW(ops::embedding_forward(ids, table, wrong_rows), Error);
  Tensor wrong_dim = ctx.zeros(Shape{4, 3}, DType::f32);  // 12 elements, but rows of 3
  EXPECT_THROW(ops::embedding_forward(ids, table, wrong_dim), Error);
  Tensor bf16_out = ctx.zeros(Shape{3, 4}, DType::bf16);
  EXPECT_THROW(ops::embedding_forward(ids, table, bf16_out), Error);
  EXPECT_THROW(ops::embedding_backward(ids, bf16_out, table), Error);
}

}  // namespace
}  // namespace tessera::testing
