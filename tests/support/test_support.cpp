// Test helpers: seeds, random and poisoned tensors, comparisons.
#include "tests/support/test_support.h"

#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <sstream>

#include "core/cuda_runtime.h"
#include "io/hdf5_version.h"

namespace tessera::testing {
namespace {

// HDF5's own at-exit handler, in a process that opened a damaged file on
// purpose (the checkpoint and dataset tests do), prints "HDF5: infinite loop
// closing library" and a line of its free lists: objects of a file it could
// not close. The `tessera` program skips that handler (apps/main.cpp), and so
// does every test binary: this runs before main(), before any HDF5 call.
[[maybe_unused]] const bool hdf5_shutdown_skipped = (skip_hdf5_shutdown_at_exit(), true);

}  // namespace

uint64_t test_seed() {
  static const uint64_t seed = [] {
    if (const char* text = std::getenv("TESSERA_TEST_SEED"); text && *text)
      return uint64_t(std::strtoull(text, nullptr, 10));
    std::random_device device;
    return (uint64_t(device()) << 32) ^ device();
  }();
  return seed;
}

std::mt19937_64 make_rng() {
  std::string name = "no-test";
  if (const auto* info = ::testing::UnitTest::GetInstance()->current_test_info())
    name = std::string(info->test_suite_name()) + "." + info->name();
  return std::mt19937_64(test_seed() ^ std::hash<std::string>{}(name));
}

std::vector<double> round_to(DType dtype, std::vector<double> values) {
  for (double& v : values) {
    switch (dtype) {
      case DType::f32:
        v = double(float(v));
        break;
      case DType::bf16:
        v = double(float(bf16(float(v))));
        break;
      case DType::f16:
        v = double(float(f16(float(v))));
        break;
      default:
        v = std::trunc(v);
        break;
    }
  }
  return values;
}

RandomTensor random_tensor(Context& ctx, const Shape& shape, DType dtype, std::mt19937_64& rng, double low, double high,
                           Device device) {
  std::uniform_real_distribution<double> dist(low, high);
  std::vector<double> values(size_t(shape.numel()));
  for (double& v : values) v = dist(rng);
  values = round_to(dtype, std::move(values));
  Tensor t = ctx.from_doubles(shape, dtype, values, device);
  return {t, values};
}

RandomTensor random_indices(Context& ctx, const Shape& shape, DType dtype, std::mt19937_64& rng, int64_t low,
                            int64_t high, Device device) {
  std::uniform_int_distribution<int64_t> dist(low, high - 1);
  std::vector<double> values(size_t(shape.numel()));
  for (double& v : values) v = double(dist(rng));
  return {ctx.from_doubles(shape, dtype, values, device), values};
}

Tensor poisoned(Context& ctx, const Shape& shape, DType dtype, Device device) {
  Tensor t = ctx.empty(shape, dtype, device);
  t.fill_(is_floating(dtype) ? std::numeric_limits<double>::quiet_NaN() : 0x7fffffff * 1.0);
  return t;
}

::testing::AssertionResult all_close(const std::vector<double>& actual, const std::vector<double>& expected,
                                     Tolerance tolerance) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure() << "size " << actual.size() << " != expected size " << expected.size();
  size_t bad = 0, worst = 0;
  double worst_excess = -1;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double allowed = tolerance.abs + tolerance.rel * std::abs(expected[i]);
    const double error = std::abs(actual[i] - expected[i]);
    const bool ok = std::isfinite(actual[i]) ? error <= allowed : actual[i] == expected[i];
    if (!ok) {
      ++bad;
      const double excess = std::isnan(error) ? std::numeric_limits<double>::infinity() : error / allowed;
      if (excess > worst_excess) worst_excess = excess, worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  std::ostringstream out;
  out.precision(9);
  out << bad << " of " << actual.size() << " elements differ (tolerance rel " << tolerance.rel << ", abs "
      << tolerance.abs << "); worst at index " << worst << ": actual " << actual[worst] << ", expected "
      << expected[worst];
  return ::testing::AssertionFailure() << out.str();
}

::testing::AssertionResult all_close(const Tensor& actual, const std::vector<double>& expected, Tolerance tolerance) {
  return all_close(actual.to_doubles(), expected, tolerance);
}

::testing::AssertionResult all_close(const Tensor& actual, const Tensor& expected, Tolerance tolerance) {
  if (actual.shape() != expected.shape())
    return ::testing::AssertionFailure() << "shape " << actual.shape().to_string()
                                         << " != " << expected.shape().to_string();
  return all_close(actual.to_doubles(), expected.to_doubles(), tolerance);
}

bool gpu_available(const Context& ctx) {
  return ctx.cuda_device_count() > 0;
}

std::string no_gpu_reason() {
  if (!cuda_runtime::compiled())
    return "skipped: this build has no CUDA backend (configured with TESSERA_CUDA=OFF or without nvcc)";
  return "skipped: no CUDA device on this machine (the CUDA backend is built; this test runs where a GPU exists)";
}

}  // namespace tessera::testing
