// Shared helpers for Tessera's tests: fresh random inputs (the seed is new in
// every run and printed on failure; TESSERA_TEST_SEED=N replays a run),
// poisoned outputs, tolerances per dtype, element-wise comparison with a
// report of the worst element, and GPU skipping.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/context.h"
#include "core/tensor.h"

namespace tessera::testing {

// This process's seed: TESSERA_TEST_SEED if set, otherwise from std::random_device.
uint64_t test_seed();

// A generator seeded from test_seed() and the current test's name, so tests
// draw independent streams and a failing one can be replayed alone.
std::mt19937_64 make_rng();

// Adds "seed=N (replay with TESSERA_TEST_SEED=N)" to every failure message in scope.
#define TESSERA_SEED_TRACE() \
  SCOPED_TRACE("seed=" + std::to_string(::tessera::testing::test_seed()) + " (replay with TESSERA_TEST_SEED=N)")

// Values as `dtype` stores them (rounded to bf16/f16 when needed).
std::vector<double> round_to(DType dtype, std::vector<double> values);

struct RandomTensor {
  Tensor tensor;               // on the requested device
  std::vector<double> values;  // exactly the stored values, for references
};

// Uniform values in [low, high), rounded to `dtype`; never all zeros.
RandomTensor random_tensor(Context& ctx, const Shape& shape, DType dtype, std::mt19937_64& rng, double low = -1.0,
                           double high = 1.0, Device device = Device::cpu());
// Integers uniform in [low, high) (ids, targets, labels).
RandomTensor random_indices(Context& ctx, const Shape& shape, DType dtype, std::mt19937_64& rng, int64_t low,
                            int64_t high, Device device = Device::cpu());
// A tensor whose every element is NaN (floating dtypes) or a huge sentinel
// (integers): an element the operator forgets to write fails the comparison.
Tensor poisoned(Context& ctx, const Shape& shape, DType dtype, Device device = Device::cpu());

struct Tolerance {
  double rel;
  double abs;
};

// |actual − expected| ≤ abs + rel·|expected| for every element, NaN never
// passes. Reports the count of bad elements and the worst one.
::testing::AssertionResult all_close(const std::vector<double>& actual, const std::vector<double>& expected,
                                     Tolerance tolerance);
::testing::AssertionResult all_close(const Tensor& actual, const std::vector<double>& expected, Tolerance tolerance);
::testing::AssertionResult all_close(const Tensor& actual, const Tensor& expected, Tolerance tolerance);

// GPU comparisons: skip with a message that says why when there is no device.
bool gpu_available(const Context& ctx);
std::string no_gpu_reason();
#define TESSERA_REQUIRE_GPU(ctx) \
  if (!::tessera::testing::gpu_available(ctx)) GTEST_SKIP() << ::tessera::testing::no_gpu_reason()

}  // namespace tessera::testing
