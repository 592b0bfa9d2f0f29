// Rotary position embedding (ops::rotary_forward / rotary_backward) of grouped
// projections [B, T, G, R + 2, Dh]: forward against a double reference that
// rotates the half-split pairs (i, i + Dh/2) of every query and key slot and
// leaves the value, with the angle formed as transformers forms it in f32
// (and, looser, against the exact angle in double); positions starting past
// 0 and non-contiguous, i32 and i64, bases 10000 and 500000, multi-query to
// multi-head groupings, in place; backward against the reference's transpose,
// central differences, and as the inverse of the forward; GPU against CPU;
// argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "kernels/ops.h"
#include "tests/kernels/dtype_params.h"
#include "tests/support/gradcheck.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

struct Dims {
  int64_t batch, seq_len, groups, per_group, head_dim;  // B, T, G, R, Dh

  Shape qkv() const { return Shape{batch, seq_len, groups, per_group + 2, head_dim}; }
  std::string describe() const {
    return "B=" + std::to_string(batch) + " T=" + std::to_string(seq_len) + " G=" + std::to_string(groups) +
           " R=" + std::to_string(per_group) + " Dh=" + std::to_string(head_dim);
  }
};

// How the reference forms the angle of pair i at position p.
enum class Angle {
  // As transformers' LlamaRotaryEmbedding: inv_freq = 1 / base^(f32(2i) / Dh)
  // and angle = f32(p)·inv_freq, every step rounded to f32 (base is an f32 value).
  transformers_f32,
  // p·base^(−2i/Dh) in double.
  exact,
};

double angle_of(int64_t position, int64_t i, int64_t head_dim, double base, Angle angle) {
  if (angle == Angle::exact) return double(position) * std::pow(base, -2.0 * double(i) / double(head_dim));
  // torch.arange(0, Dh, 2).float() / Dh, then base ** that in f32 (torch's
  // pow: the f32 rounding of the power), then 1.0 / that in f32.
  const float exponent = float(2 * i) / float(head_dim);
  const float inv_freq = 1.0f / float(std::pow(base, double(exponent)));
  return double(float(position) * inv_freq);
}

// Rotates every query and key slot by sign·angle (sign −1: the inverse, which
// for a rotation is its transpose), pairs (i, i + Dh/2); copies the value.
std::vector<double> reference_rotary(const Dims& g, const std::vector<double>& x, const std::vector<int64_t>& positions,
                                     double base, double sign, Angle angle = Angle::transformers_f32) {
  std::vector<double> y(x.size());
  const int64_t half = g.head_dim / 2, slots = g.per_group + 2;
  for (int64_t b = 0; b < g.batch; ++b)
    for (int64_t t = 0; t < g.seq_len; ++t)
      for (int64_t group = 0; group < g.groups; ++group)
        for (int64_t slot = 0; slot < slots; ++slot) {
          const size_t row = size_t((((b * g.seq_len + t) * g.groups + group) * slots + slot) * g.head_dim);
          for (int64_t i = 0; i < half; ++i) {
            const double x1 = x[row + size_t(i)], x2 = x[row + size_t(i + half)];
            if (slot == slots - 1) {  // the value
              y[row + size_t(i)] = x1;
              y[row + size_t(i + half)] = x2;
              continue;
            }
            const double a = sign * angle_of(positions[size_t(t)], i, g.head_dim, base, angle);
            y[row + size_t(i)] = x1 * std::cos(a) - x2 * std::sin(a);
            y[row + size_t(i + half)] = x2 * std::cos(a) + x1 * std::sin(a);
          }
        }
  return y;
}

struct Case {
  Dims dims;
  std::vector<int64_t> positions;
  float base;
};

// T positions starting at `first`.
std::vector<int64_t> contiguous(int64_t first, int64_t count) {
  std::vector<int64_t> positions(static_cast<size_t>(count));
  std::iota(positions.begin(), positions.end(), first);
  return positions;
}

// T distinct positions in [0, 4096), in no order (context parallelism hands a
// rank chunks from both ends of a sequence).
std::vector<int64_t> scattered(int64_t count, std::mt19937_64& rng) {
  std::vector<int64_t> all = contiguous(0, 4096);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(count));
  return all;
}

// Multi-query, grouped and multi-head groupings; Dh 64, 16 and 8; positions
// from 0, from a later chunk, and scattered; Llama 2's base and Llama 3's; a
// batch of tokens across the CPU's threading grain (split between threads).
std::vector<Case> cases(std::mt19937_64& rng) {
  return {
      Case{Dims{3, 67, 2, 3, 16}, contiguous(5, 67), 10000.0f},
      Case{Dims{2, 13, 1, 4, 64}, contiguous(0, 13), 10000.0f},
      Case{Dims{1, 7, 2, 3, 8}, contiguous(1000, 7), 10000.0f},
      Case{Dims{2, 5, 3, 1, 64}, scattered(5, rng), 500000.0f},
      Case{Dims{1, 9, 2, 2, 8}, scattered(9, rng), 10000.0f},
      Case{Dims{1, 3, 1, 1, 2}, contiguous(37, 3), 500000.0f},
  };
}

Tensor positions_tensor(Context& ctx, const std::vector<int64_t>& positions, DType dtype,
                        Device device = Device::cpu()) {
  const Shape shape{int64_t(positions.size())};
  if (dtype == DType::i64) return ctx.from_vector(shape, positions, device);
  return ctx.from_vector(shape, std::vector<int32_t>(positions.begin(), positions.end()), device);
}

class Rotary : public DtypeTest {};

TEST_P(Rotary, Forward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const Case& c : cases(rng))
    for (const DType index : {DType::i32, DType::i64}) {
      SCOPED_TRACE(c.dims.describe() + " base=" + std::to_string(c.base) + " positions from " +
                   std::to_string(c.positions[0]) + " " + std::string(dtype_name(index)));
      auto qkv = random_tensor(ctx, c.dims.qkv(), dtype, rng);
      const Tensor positions = positions_tensor(ctx, c.positions, index);
      Tensor out = poisoned(ctx, c.dims.qkv(), dtype);
      ops::rotary_forward(qkv.tensor, positions, out, c.base);
      const auto expected = reference_rotary(c.dims, qkv.values, c.positions, c.base, 1.0);
      EXPECT_TRUE(all_close(out, expected, forward_tolerance(dtype)));

      // In place: out may be qkv itself.
      ops::rotary_forward(qkv.tensor, positions, qkv.tensor, c.base);
      EXPECT_TRUE(all_close(qkv.tensor, expected, forward_tolerance(dtype))) << "in place";
    }
}

// The angle formed in f32 (as transformers does) is off the exact one by a
// few f32 roundings of numbers below 4096 (the exponent's quotient, the power,
// the reciprocal, the product with the position): say 4·4096·2^-24 radians;
// with |x| ≤ 1 an output moves by at most that times |x1| + |x2| ≤ 2, about
// 2e-3. A wrong frequency, pairing or position would be off by O(1).
TEST(RotaryAngle, WithinF32RoundingOfTheExactAngle) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  for (const Case& c : cases(rng)) {
    SCOPED_TRACE(c.dims.describe());
    auto qkv = random_tensor(ctx, c.dims.qkv(), DType::f32, rng);
    Tensor out = poisoned(ctx, c.dims.qkv(), DType::f32);
    ops::rotary_forward(qkv.tensor, positions_tensor(ctx, c.positions, DType::i64), out, c.base);
    EXPECT_TRUE(all_close(out, reference_rotary(c.dims, qkv.values, c.positions, c.base, 1.0, Angle::exact),
                          Tolerance{0, 2.0 * 4.0 * 4096.0 * std::ldexp(1.0, -24)}));
  }
}

TEST_P(Rotary, Backward) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  auto rng = make_rng();
  for (const Case& c : cases(rng)) {
    SCOPED_TRACE(c.dims.describe());
    const Tensor positions = positions_tensor(ctx, c.positions, DType::i64);
    auto grad_out = random_tensor(ctx, c.dims.qkv(), dtype, rng);
    Tensor grad_qkv = poisoned(ctx, c.dims.qkv(), dtype);
    ops::rotary_backward(grad_out.tensor, positions, grad_qkv, c.base);
    // The transpose of the forward's rotation: the rotation by −angle.
    const auto transpose = reference_rotary(c.dims, grad_out.values, c.positions, c.base, -1.0);
    EXPECT_TRUE(all_close(grad_qkv, transpose, backward_tolerance(dtype))) << "transpose";
    // Central differences of the reference forward (on the smaller cases).
    if (c.dims.qkv().numel() <= 1024) {
      const auto f = [&](const Inputs& in) { return reference_rotary(c.dims, in[0], c.positions, c.base, 1.0); };
      auto x = random_tensor(ctx, c.dims.qkv(), dtype, rng);
      EXPECT_TRUE(
          all_close(grad_qkv, numeric_gradient(f, Inputs{x.values}, 0, grad_out.values), backward_tolerance(dtype)))
          << "numeric";
    }
    // In place, and undoing the forward: backward(forward(x)) = x.
    ops::rotary_backward(grad_out.tensor, positions, grad_out.tensor, c.base);
    EXPECT_TRUE(all_close(grad_out.tensor, transpose, backward_tolerance(dtype))) << "in place";
    if (dtype == DType::f32) {
      auto x = random_tensor(ctx, c.dims.qkv(), dtype, rng);
      Tensor rotated = poisoned(ctx, c.dims.qkv(), dtype), back = poisoned(ctx, c.dims.qkv(), dtype);
      ops::rotary_forward(x.tensor, positions, rotated, c.base);
      ops::rotary_backward(rotated, positions, back, c.base);
      EXPECT_TRUE(all_close(back, x.values, Tolerance{1e-5, 1e-6})) << "inverse";
    }
  }
}

TEST_P(Rotary, GpuMatchesCpu) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  const Device gpu = Device::cuda(0);
  auto rng = make_rng();
  std::vector<Case> all = cases(rng);
  all.push_back(Case{Dims{2, 257, 4, 2, 128}, scattered(257, rng), 500000.0f});
  for (const Case& c : all)
    for (const DType index : {DType::i32, DType::i64}) {
      SCOPED_TRACE(c.dims.describe());
      auto x = random_tensor(ctx, c.dims.qkv(), dtype, rng);
      const Tensor positions = positions_tensor(ctx, c.positions, index);
      Tensor out_cpu = poisoned(ctx, c.dims.qkv(), dtype), out_gpu = poisoned(ctx, c.dims.qkv(), dtype, gpu);
      ops::rotary_forward(x.tensor, positions, out_cpu, c.base);
      ops::rotary_forward(x.tensor.to(gpu), positions.to(gpu), out_gpu, c.base);
      EXPECT_TRUE(all_close(out_gpu, out_cpu, device_tolerance(dtype))) << "forward";
      Tensor back_cpu = poisoned(ctx, c.dims.qkv(), dtype), back_gpu = poisoned(ctx, c.dims.qkv(), dtype, gpu);
      ops::rotary_backward(x.tensor, positions, back_cpu, c.base);
      ops::rotary_backward(x.tensor.to(gpu), positions.to(gpu), back_gpu, c.base);
      EXPECT_TRUE(all_close(back_gpu, back_cpu, device_tolerance(dtype))) << "backward";
    }
}

TEST_P(Rotary, RejectsBadArguments) {
  const DType dtype = GetParam();
  Context ctx;
  const Dims g{2, 5, 2, 3, 8};
  Tensor qkv = ctx.zeros(g.qkv(), dtype), out = ctx.zeros(g.qkv(), dtype);
  Tensor positions = ctx.zeros(Shape{5}, DType::i64);
  EXPECT_NO_THROW(ops::rotary_forward(qkv, positions, out, 10000.0f));
  EXPECT_NO_THROW(ops::rotary_backward(qkv, positions, out, 10000.0f));

  Tensor odd = ctx.zeros(Shape{2, 5, 2, 5, 7}, dtype);  // Dh = 7: no pairs
  EXPECT_THROW(ops::rotary_forward(odd, positions, odd, 10000.0f), Error);
  Tensor no_queries = ctx.zeros(Shape{2, 5, 2, 2, 8}, dtype);
  EXPECT_THROW(ops::rotary_forward(no_queries, positions, no_queries, 10000.0f), Error);
  Tensor four_dims = ctx.zeros(Shape{2, 5, 10, 8}, dtype);
  EXPECT_THROW(ops::rotary_forward(four_dims, positions, four_dims, 10000.0f), Error);
  Tensor short_positions = ctx.zeros(Shape{4}, DType::i64);
  EXPECT_THROW(ops::rotary_forward(qkv, short_positions, out, 10000.0f), Error);
  Tensor float_positions = ctx.zeros(Shape{5}, DType::f32);
  EXPECT_THROW(ops::rotary_forward(qkv, float_positions, out, 10000.0f), Error);
  EXPECT_THROW(ops::rotary_forward(qkv, positions, out, 0.0f), Error);
  EXPECT_THROW(ops::rotary_forward(qkv, positions, out, -1.0f), Error);
  EXPECT_THROW(ops::rotary_forward(qkv, positions, out, NAN), Error);
  Tensor other_dtype = ctx.zeros(g.qkv(), dtype == DType::f32 ? DType::bf16 : DType::f32);
  EXPECT_THROW(ops::rotary_forward(qkv, positions, other_dtype, 10000.0f), Error);
  Tensor wrong_shape = ctx.zeros(Shape{2, 5, 2, 3, 6}, dtype);
  EXPECT_THROW(ops::rotary_backward(qkv, positions, wrong_shape, 10000.0f), Error);
  // A partial overlap of input and output is refused (in place is fine).
  Tensor storage = ctx.zeros(Shape{g.qkv().numel() + 8}, dtype);
  Tensor input = storage.flatten().slice(0, g.qkv().numel()).view(g.qkv());
  Tensor shifted = storage.flatten().slice(8, g.qkv().numel() + 8).view(g.qkv());
  EXPECT_THROW(ops::rotary_forward(input, positions, shifted, 10000.0f), Error);
}

INSTANTIATE_FLOAT_DTYPES(Rotary);

}  // namespace
}  // namespace tessera::testing
