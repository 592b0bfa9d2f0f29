// ops::split_qkv / join_qkv: the queries and compact key/value block ring
// attention takes, out of GPT-2's [B, T, 3, H, Dh] and the grouped
// [B, T, G, R + 2, Dh] projections, against a reference that reads every
// element by the layouts' definitions (nested loops over head, slot and
// feature, written here); join against the same placement, from f32 and from
// the projections' dtype; split then join gives the projections back; outputs
// poisoned; shapes refused naming the argument.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kernels/ops.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

struct Case {
  bool grouped;
  int64_t batch, tokens, groups, per_group, head_dim;  // GPT-2's: groups = H heads, per_group 1
  int64_t heads() const { return groups * per_group; }
  Shape qkv() const {
    return grouped ? Shape{batch, tokens, groups, per_group + 2, head_dim} : Shape{batch, tokens, 3, groups, head_dim};
  }
  Shape q() const { return Shape{batch, tokens, heads(), head_dim}; }
  Shape kv() const { return Shape{batch, tokens, groups, 2, head_dim}; }
  // The offset in qkv of (token, query head h, d), and of (token, group g, key (0) or value (1), d).
  int64_t query_at(int64_t token, int64_t h, int64_t d) const {
    if (!grouped) return ((token * 3 + 0) * groups + h) * head_dim + d;
    return ((token * groups + h / per_group) * (per_group + 2) + h % per_group) * head_dim + d;
  }
  int64_t kv_at(int64_t token, int64_t g, int64_t slot, int64_t d) const {
    if (!grouped) return ((token * 3 + 1 + slot) * groups + g) * head_dim + d;
    return ((token * groups + g) * (per_group + 2) + per_group + slot) * head_dim + d;
  }
};

struct Expected {
  std::vector<double> q, kv;
};
Expected reference_split(const Case& c, const std::vector<double>& qkv) {
  Expected out;
  for (int64_t token = 0; token < c.batch * c.tokens; ++token) {
    for (int64_t h = 0; h < c.heads(); ++h)
      for (int64_t d = 0; d < c.head_dim; ++d) out.q.push_back(qkv[size_t(c.query_at(token, h, d))]);
    for (int64_t g = 0; g < c.groups; ++g)
      for (int64_t slot = 0; slot < 2; ++slot)
        for (int64_t d = 0; d < c.head_dim; ++d) out.kv.push_back(qkv[size_t(c.kv_at(token, g, slot, d))]);
  }
  return out;
}
std::vector<double> reference_join(const Case& c, const std::vector<double>& q, const std::vector<double>& kv) {
  std::vector<double> out(size_t(c.qkv().numel()), 0.0);
  size_t qi = 0, ki = 0;
  for (int64_t token = 0; token < c.batch * c.tokens; ++token) {
    for (int64_t h = 0; h < c.heads(); ++h)
      for (int64_t d = 0; d < c.head_dim; ++d) out[size_t(c.query_at(token, h, d))] = q[qi++];
    for (int64_t g = 0; g < c.groups; ++g)
      for (int64_t slot = 0; slot < 2; ++slot)
        for (int64_t d = 0; d < c.head_dim; ++d) out[size_t(c.kv_at(token, g, slot, d))] = kv[ki++];
  }
  return out;
}

const std::vector<Case> kCases = {
    {false, 2, 5, 3, 1, 4},  // GPT-2's: 3 heads
    {true, 2, 5, 2, 3, 4},   // 2 key/value groups of 3 query heads
    {true, 1, 7, 1, 4, 6},   // multi-query
    {true, 3, 2, 4, 1, 2},   // G = H in the grouped layout
};

class QkvSplit : public DtypeTest {};

TEST_P(QkvSplit, SplitJoinAndRoundTripFollowTheLayouts) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  const DType dtype = GetParam();
  for (const Case& c : kCases) {
    SCOPED_TRACE(std::string(c.grouped ? "grouped" : "GPT-2's") + " G " + std::to_string(c.groups) + " R " +
                 std::to_string(c.per_group));
    const RandomTensor qkv = random_tensor(ctx, c.qkv(), dtype, rng);
    Tensor q = poisoned(ctx, c.q(), dtype), kv = poisoned(ctx, c.kv(), dtype);
    ops::split_qkv(qkv.tensor, c.grouped, q, kv);
    const Expected split = reference_split(c, qkv.values);
    EXPECT_TRUE(all_close(q, split.q, Tolerance{0, 0}));  // copies: exact
    EXPECT_TRUE(all_close(kv, split.kv, Tolerance{0, 0}));

    Tensor back = poisoned(ctx, c.qkv(), dtype);
    ops::join_qkv(q, kv, c.grouped, back);
    EXPECT_TRUE(all_close(back, qkv.values, Tolerance{0, 0}));  // every element written, in place

    const RandomTensor grad_q = random_tensor(ctx, c.q(), DType::f32, rng);
    const RandomTensor grad_kv = random_tensor(ctx, c.kv(), DType::f32, rng);
    Tensor grad_qkv = poisoned(ctx, c.qkv(), dtype);
    ops::join_qkv(grad_q.tensor, grad_kv.tensor, c.grouped, grad_qkv);
    EXPECT_TRUE(all_close(grad_qkv, round_to(dtype, reference_join(c, grad_q.values, grad_kv.values)),
                          Tolerance{0, 0}));
  }
}

TEST_P(QkvSplit, ShapesThatDoNotMatchAreRefusedNamingTheArgument) {
  Context ctx;
  const DType dtype = GetParam();
  const Case c = kCases[1];
  const Tensor qkv = ctx.zeros(c.qkv(), dtype);
  Tensor q = ctx.zeros(c.q(), dtype), kv = ctx.zeros(c.kv(), dtype);
  Tensor wrong_kv = ctx.zeros(Shape{c.batch, c.tokens, c.groups, 3, c.head_dim}, dtype);
  EXPECT_THROW(ops::split_qkv(qkv, true, q, wrong_kv), Error);
  Tensor packed = ctx.zeros(Shape{c.batch, c.tokens, 4, c.heads(), c.head_dim}, dtype);
  EXPECT_THROW(ops::split_qkv(packed, false, q, kv), Error);  // GPT-2's layout has 3 slots
  Tensor grad_i32 = ctx.zeros(c.q(), DType::i32);
  Tensor grad_qkv = ctx.zeros(c.qkv(), dtype);
  EXPECT_THROW(ops::join_qkv(grad_i32, kv, true, grad_qkv), Error);
}

// The GPU's copies are the CPU's, element for element, both layouts.
TEST_P(QkvSplit, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  std::vector<Case> cases = kCases;
  cases.push_back({true, 2, 300, 8, 4, 128});  // more than one block of threads per row
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.grouped ? "grouped" : "GPT-2's") + " G " + std::to_string(c.groups) + " R " +
                 std::to_string(c.per_group));
    const Tensor qkv = random_tensor(ctx, c.qkv(), dtype, rng).tensor;
    Tensor q_cpu = poisoned(ctx, c.q(), dtype), kv_cpu = poisoned(ctx, c.kv(), dtype);
    Tensor q_gpu = poisoned(ctx, c.q(), dtype, gpu), kv_gpu = poisoned(ctx, c.kv(), dtype, gpu);
    ops::split_qkv(qkv, c.grouped, q_cpu, kv_cpu);
    ops::split_qkv(qkv.to(gpu), c.grouped, q_gpu, kv_gpu);
    EXPECT_TRUE(all_close(q_gpu, q_cpu.to_doubles(), Tolerance{0, 0})) << "q";
    EXPECT_TRUE(all_close(kv_gpu, kv_cpu.to_doubles(), Tolerance{0, 0})) << "kv";
    const Tensor grad_q = random_tensor(ctx, c.q(), DType::f32, rng).tensor;
    const Tensor grad_kv = random_tensor(ctx, c.kv(), DType::f32, rng).tensor;
    Tensor joined_cpu = poisoned(ctx, c.qkv(), dtype), joined_gpu = poisoned(ctx, c.qkv(), dtype, gpu);
    ops::join_qkv(grad_q, grad_kv, c.grouped, joined_cpu);
    ops::join_qkv(grad_q.to(gpu), grad_kv.to(gpu), c.grouped, joined_gpu);
    EXPECT_TRUE(all_close(joined_gpu, joined_cpu.to_doubles(), Tolerance{0, 0})) << "join";
  }
}

INSTANTIATE_FLOAT_DTYPES(QkvSplit);

}  // namespace
}  // namespace tessera::testing
