// ops::moe_permute / moe_combine and their backwards (the mixture of
// experts' token dispatch) against double references written here, for
// random plans: every token's K choices assigned to random experts, the
// slots grouped by expert in token order, some choices dropped (as over
// capacity), a token with every choice dropped; f32/bf16/f16 with outputs
// poisoned before the call. The combine and its backward also satisfy the
// adjoint identity <combine(ys), g> = <ys, grad_ys> + nothing else, and
// the permute's backward is the adjoint of the permute. Plans and shapes
// that do not fit are refused; the GPU's functors equal the CPU's.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

struct Plan {
  int64_t tokens, top_k, width;
  std::vector<int32_t> pairs;    // [M]
  std::vector<int32_t> slot_of;  // [N·K], −1 dropped
  int64_t slots() const { return int64_t(pairs.size()); }
};

// N tokens, K distinct experts each out of E, slots grouped by expert in
// token order; about one choice in five dropped, and token 0's all.
Plan random_plan(int64_t tokens, int64_t top_k, int64_t experts, int64_t width, std::mt19937_64& rng) {
  Plan plan{tokens, top_k, width, {}, std::vector<int32_t>(size_t(tokens * top_k), -1)};
  std::vector<std::vector<int32_t>> by_expert(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> choice(static_cast<size_t>(experts));
    for (int64_t e = 0; e < experts; ++e) choice[size_t(e)] = int32_t(e);
    std::shuffle(choice.begin(), choice.end(), rng);
    for (int64_t j = 0; j < top_k; ++j) {
      const bool dropped = t == 0 || rng() % 5 == 0;
      if (!dropped) by_expert[size_t(choice[size_t(j)])].push_back(int32_t(t * top_k + j));
    }
  }
  for (const auto& pairs : by_expert)
    for (const int32_t pair : pairs) {
      plan.slot_of[size_t(pair)] = int32_t(plan.pairs.size());
      plan.pairs.push_back(pair);
    }
  return plan;
}

struct PlanTensors {
  Tensor pairs, slot_of;
};
PlanTensors tensors_of(Context& ctx, const Plan& p, Device device = Device::cpu()) {
  return {ctx.from_vector(Shape{p.slots()}, p.pairs, device),
          ctx.from_vector(Shape{p.tokens, p.top_k}, p.slot_of, device)};
}

const int64_t kShapes[][4] = {{13, 2, 4, 24}, {40, 1, 8, 7}, {9, 4, 4, 64}};  // N, K, E, C

class MoeDispatch : public DtypeTest {};

TEST_P(MoeDispatch, PermuteAndItsBackwardMatchTheReference) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const auto& shape : kShapes) {
    const Plan p = random_plan(shape[0], shape[1], shape[2], shape[3], rng);
    const PlanTensors plan = tensors_of(ctx, p);
    const RandomTensor x = random_tensor(ctx, Shape{p.tokens, p.width}, dtype, rng);
    Tensor out = poisoned(ctx, Shape{p.slots(), p.width}, dtype);
    ops::moe_permute(x.tensor, plan.pairs, p.top_k, out);
    std::vector<double> expected;
    for (const int32_t pair : p.pairs)
      for (int64_t c = 0; c < p.width; ++c) expected.push_back(x.values[size_t((pair / p.top_k) * p.width + c)]);
    EXPECT_TRUE(all_close(out, expected, Tolerance{0, 0})) << "permute";

    const RandomTensor grad_slots = random_tensor(ctx, Shape{p.slots(), p.width}, dtype, rng);
    Tensor grad_x = poisoned(ctx, Shape{p.tokens, p.width}, dtype);
    ops::moe_permute_backward(grad_slots.tensor, plan.slot_of, grad_x);
    std::vector<double> grads(static_cast<size_t>(p.tokens * p.width), 0.0);
    for (int64_t m = 0; m < p.slots(); ++m)
      for (int64_t c = 0; c < p.width; ++c)
        grads[size_t((p.pairs[size_t(m)] / p.top_k) * p.width + c)] += grad_slots.values[size_t(m * p.width + c)];
    EXPECT_TRUE(all_close(grad_x, round_to(dtype, grads), forward_tolerance(dtype))) << "permute backward";
  }
}

TEST_P(MoeDispatch, CombineAndItsBackwardMatchTheReference) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const auto& shape : kShapes) {
    const Plan p = random_plan(shape[0], shape[1], shape[2], shape[3], rng);
    const PlanTensors plan = tensors_of(ctx, p);
    const RandomTensor ys = random_tensor(ctx, Shape{p.slots(), p.width}, dtype, rng);
    const RandomTensor weights = random_tensor(ctx, Shape{p.tokens, p.top_k}, DType::f32, rng, 0.0, 1.0);
    Tensor out = poisoned(ctx, Shape{p.tokens, p.width}, dtype);
    ops::moe_combine(ys.tensor, plan.slot_of, weights.tensor, out);
    std::vector<double> expected(static_cast<size_t>(p.tokens * p.width), 0.0);
    for (int64_t i = 0; i < p.tokens * p.top_k; ++i) {
      const int32_t slot = p.slot_of[size_t(i)];
      if (slot < 0) continue;
      for (int64_t c = 0; c < p.width; ++c)
        expected[size_t((i / p.top_k) * p.width + c)] +=
            weights.values[size_t(i)] * ys.values[size_t(slot * p.width + c)];
    }
    EXPECT_TRUE(all_close(out, round_to(dtype, expected), forward_tolerance(dtype))) << "combine";
    for (int64_t c = 0; c < p.width; ++c) EXPECT_EQ(out.to_doubles()[size_t(c)], 0.0) << "token 0 kept nothing";

    const RandomTensor grad_out = random_tensor(ctx, Shape{p.tokens, p.width}, dtype, rng);
    Tensor grad_ys = poisoned(ctx, ys.tensor.shape(), dtype);
    Tensor grad_weights = poisoned(ctx, weights.tensor.shape(), DType::f32);
    ops::moe_combine_backward(grad_out.tensor, ys.tensor, plan.pairs, plan.slot_of, weights.tensor, grad_ys,
                              grad_weights);
    std::vector<double> slots_expected, weights_expected(static_cast<size_t>(p.tokens * p.top_k), 0.0);
    for (int64_t m = 0; m < p.slots(); ++m) {
      const int64_t pair = p.pairs[size_t(m)], t = pair / p.top_k;
      for (int64_t c = 0; c < p.width; ++c) {
        slots_expected.push_back(weights.values[size_t(pair)] * grad_out.values[size_t(t * p.width + c)]);
        weights_expected[size_t(pair)] += grad_out.values[size_t(t * p.width + c)] * ys.values[size_t(m * p.width + c)];
      }
    }
    EXPECT_TRUE(all_close(grad_ys, round_to(dtype, slots_expected), forward_tolerance(dtype))) << "grad_ys";
    EXPECT_TRUE(all_close(grad_weights, weights_expected, backward_tolerance(DType::f32))) << "grad_weights";
  }
}

// The backward is the combine's adjoint in ys: <combine(ys), g> = <ys, grad_ys>, in f32.
TEST(MoeDispatchAdjoint, CombineBackwardIsTheAdjointOfCombine) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const Plan p = random_plan(31, 2, 6, 16, rng);
  const PlanTensors plan = tensors_of(ctx, p);
  const RandomTensor ys = random_tensor(ctx, Shape{p.slots(), p.width}, DType::f32, rng);
  const RandomTensor weights = random_tensor(ctx, Shape{p.tokens, p.top_k}, DType::f32, rng, 0.0, 1.0);
  const RandomTensor g = random_tensor(ctx, Shape{p.tokens, p.width}, DType::f32, rng);
  Tensor out = ctx.empty(Shape{p.tokens, p.width}, DType::f32), grad_ys = ctx.empty(ys.tensor.shape(), DType::f32);
  Tensor grad_weights = ctx.empty(weights.tensor.shape(), DType::f32);
  ops::moe_combine(ys.tensor, plan.slot_of, weights.tensor, out);
  ops::moe_combine_backward(g.tensor, ys.tensor, plan.pairs, plan.slot_of, weights.tensor, grad_ys, grad_weights);
  double left = 0.0, right = 0.0, weights_side = 0.0;
  const std::vector<double> combined = out.to_doubles(), back = grad_ys.to_doubles(), dw = grad_weights.to_doubles();
  for (size_t i = 0; i < combined.size(); ++i) left += combined[i] * g.values[i];
  for (size_t i = 0; i < back.size(); ++i) right += ys.values[i] * back[i];
  for (size_t i = 0; i < dw.size(); ++i) weights_side += weights.values[i] * dw[i];
  EXPECT_NEAR(left, right, 1e-4 * (1.0 + std::abs(left)));
  EXPECT_NEAR(left, weights_side, 1e-4 * (1.0 + std::abs(left)));  // linear in the weights too
}

TEST(MoeDispatchChecks, PlansAndShapesThatDoNotFitAreRefused) {
  Context ctx;
  const Tensor x = ctx.zeros(Shape{4, 8}, DType::f32);
  const Tensor pairs = ctx.zeros(Shape{6}, DType::i32), slot_of = ctx.zeros(Shape{4, 2}, DType::i32);
  Tensor out = ctx.zeros(Shape{6, 8}, DType::f32), narrow = ctx.zeros(Shape{6, 7}, DType::f32);
  EXPECT_NO_THROW(ops::moe_permute(x, pairs, 2, out));
  EXPECT_THROW(ops::moe_permute(x, pairs, 2, narrow), Error);
  EXPECT_THROW(ops::moe_permute(x, ctx.zeros(Shape{6}, DType::i64), 2, out), Error);
  EXPECT_THROW(ops::moe_permute(x, pairs, 0, out), Error);
  Tensor combined = ctx.zeros(Shape{4, 8}, DType::f32);
  EXPECT_THROW(ops::moe_combine(out, slot_of, ctx.zeros(Shape{4, 3}, DType::f32), combined), Error);
  EXPECT_THROW(ops::moe_combine(out, ctx.zeros(Shape{5, 2}, DType::i32), ctx.zeros(Shape{5, 2}, DType::f32), combined),
               Error);
  EXPECT_THROW(
      ops::moe_combine(ctx.zeros(Shape{6, 8}, DType::bf16), slot_of, ctx.zeros(Shape{4, 2}, DType::f32), combined),
      Error);
}

TEST_P(MoeDispatch, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  const Plan p = random_plan(500, 2, 8, 96, rng);
  const PlanTensors cpu_plan = tensors_of(ctx, p), gpu_plan = tensors_of(ctx, p, gpu);
  const Tensor x = random_tensor(ctx, Shape{p.tokens, p.width}, dtype, rng).tensor;
  const Tensor weights = random_tensor(ctx, Shape{p.tokens, p.top_k}, DType::f32, rng, 0.0, 1.0).tensor;
  const Tensor g = random_tensor(ctx, Shape{p.tokens, p.width}, dtype, rng).tensor;
  Tensor slots_cpu = poisoned(ctx, Shape{p.slots(), p.width}, dtype);
  Tensor slots_gpu = poisoned(ctx, Shape{p.slots(), p.width}, dtype, gpu);
  ops::moe_permute(x, cpu_plan.pairs, p.top_k, slots_cpu);
  ops::moe_permute(x.to(gpu), gpu_plan.pairs, p.top_k, slots_gpu);
  EXPECT_TRUE(all_close(slots_gpu, slots_cpu, Tolerance{0, 0})) << "permute";
  Tensor out_cpu = poisoned(ctx, Shape{p.tokens, p.width}, dtype);
  Tensor out_gpu = poisoned(ctx, Shape{p.tokens, p.width}, dtype, gpu);
  ops::moe_combine(slots_cpu, cpu_plan.slot_of, weights, out_cpu);
  ops::moe_combine(slots_cpu.to(gpu), gpu_plan.slot_of, weights.to(gpu), out_gpu);
  EXPECT_TRUE(all_close(out_gpu, out_cpu, device_tolerance(dtype))) << "combine";
  Tensor grad_ys_cpu = poisoned(ctx, slots_cpu.shape(), dtype),
         grad_ys_gpu = poisoned(ctx, slots_cpu.shape(), dtype, gpu);
  Tensor grad_w_cpu = poisoned(ctx, weights.shape(), DType::f32);
  Tensor grad_w_gpu = poisoned(ctx, weights.shape(), DType::f32, gpu);
  ops::moe_combine_backward(g, slots_cpu, cpu_plan.pairs, cpu_plan.slot_of, weights, grad_ys_cpu, grad_w_cpu);
  ops::moe_combine_backward(g.to(gpu), slots_cpu.to(gpu), gpu_plan.pairs, gpu_plan.slot_of, weights.to(gpu),
                            grad_ys_gpu, grad_w_gpu);
  EXPECT_TRUE(all_close(grad_ys_gpu, grad_ys_cpu, device_tolerance(dtype))) << "grad_ys";
  EXPECT_TRUE(all_close(grad_w_gpu, grad_w_cpu, device_tolerance(DType::f32))) << "grad_weights";
  Tensor grad_x_cpu = poisoned(ctx, x.shape(), dtype), grad_x_gpu = poisoned(ctx, x.shape(), dtype, gpu);
  ops::moe_permute_backward(grad_ys_cpu, cpu_plan.slot_of, grad_x_cpu);
  ops::moe_permute_backward(grad_ys_cpu.to(gpu), gpu_plan.slot_of, grad_x_gpu);
  EXPECT_TRUE(all_close(grad_x_gpu, grad_x_cpu, device_tolerance(dtype))) << "permute backward";
}

INSTANTIATE_FLOAT_DTYPES(MoeDispatch);

}  // namespace
}  // namespace tessera::testing
