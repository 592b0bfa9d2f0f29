// Parameterising kernel tests over dtypes, and the tolerances each dtype gets.
//
// Tolerances, and why:
//   forward, against a double reference on the same (rounded) inputs:
//     f32   rel 1e-5: float arithmetic and libm agree with double to a few ulp
//                     (2^-24 ≈ 6e-8 each) even after sums of a few thousand terms;
//     bf16  rel 1e-2: the result is rounded to 8 mantissa bits (half an ulp = 2^-9 ≈ 2e-3)
//                     after f32 math on already-rounded inputs;
//     f16   rel 2e-3: rounded to 11 bits (half an ulp = 2^-12 ≈ 2.4e-4), with headroom.
//   backward, against central differences of the double reference: the
//     numerical derivative is good to ~1e-9, so the same bounds apply, with a
//     little more absolute slack for gradients that cancel to near zero.
//   device, GPU against CPU: both compute in f32 but may sum in another order
//     and use other libm implementations; results land on the same grid, so
//     bf16/f16 may differ by one unit in the last place.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "core/dtype.h"
#include "tests/support/test_support.h"

namespace tessera::testing {

class DtypeTest : public ::testing::TestWithParam<DType> {};

inline std::string dtype_param_name(const ::testing::TestParamInfo<DType>& info) {
  return std::string(dtype_name(info.param));
}

#define INSTANTIATE_FLOAT_DTYPES(suite)                                                           \
  INSTANTIATE_TEST_SUITE_P(Dtypes, suite, ::testing::Values(DType::f32, DType::bf16, DType::f16), \
                           ::tessera::testing::dtype_param_name)

inline Tolerance forward_tolerance(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return {1e-2, 1e-2};
    case DType::f16:
      return {2e-3, 1e-3};
    default:
      return {1e-5, 1e-6};
  }
}

inline Tolerance backward_tolerance(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return {1e-2, 1e-2};
    case DType::f16:
      return {2e-3, 2e-3};
    default:
      return {1e-5, 1e-5};
  }
}

inline Tolerance device_tolerance(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return {8e-3, 1e-3};
    case DType::f16:
      return {1e-3, 1e-4};
    default:
      return {1e-5, 1e-6};
  }
}

}  // namespace tessera::testing
