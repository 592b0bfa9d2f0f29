// Uses the installed Tessera: builds tensors, runs an operator, checks it
// against the formula, and prints OK.
#include <cmath>
#include <cstdio>

#include "core/context.h"
#include "kernels/ops.h"

int main() {
  tessera::Context ctx;
  tessera::Tensor x = ctx.empty(tessera::Shape{3, 5}, tessera::DType::f32);
  x.uniform_at_(42, 0, 0, -2.0f, 2.0f);
  tessera::Tensor y = ctx.empty(x.shape(), tessera::DType::f32);
  tessera::ops::relu_forward(x, y);
  const auto in = x.to_vector<float>(), out = y.to_vector<float>();
  for (size_t i = 0; i < in.size(); ++i) {
    if (out[i] != (in[i] > 0 ? in[i] : 0.0f)) {
      std::printf("FAIL at %zu: relu(%g) = %g\n", i, double(in[i]), double(out[i]));
      return 1;
    }
  }
  std::printf("OK: installed Tessera works (%s)\n", ctx.describe().c_str());
  return 0;
}
