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
