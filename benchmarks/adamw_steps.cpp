// adamw_steps: Tessera's AdamW (ops::adamw_step on the CPU) over a sequence
// of gradients read from a file, for benchmarks/adamw_compare.py, which runs
// torch.optim.AdamW on the same numbers and compares the two. Input (--input):
// raw little-endian f32, the initial parameters [size] then the gradients
// [steps, size]; output (--output): the final parameters, exp_avg and
// exp_avg_sq, [3, size] f32. The hyper-parameters are read as doubles, as
// torch holds them.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/context.h"
#include "kernels/ops.h"

namespace {

std::vector<float> read_floats(const std::string& path, int64_t count) {
  std::vector<float> values(size_t(count), 0.0f);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(values.data()), std::streamsize(values.size() * sizeof(float)));
  if (!in) throw std::runtime_error(path + ": expected " + std::to_string(count) + " f32 values");
  return values;
}

void write_tensors(const std::string& path, const std::vector<const tessera::Tensor*>& tensors) {
  std::ofstream out(path, std::ios::binary);
  for (const tessera::Tensor* tensor : tensors) {
    const std::vector<float> values = tensor->to_vector<float>();
    out.write(reinterpret_cast<const char*>(values.data()), std::streamsize(values.size() * sizeof(float)));
  }
  if (!out) throw std::runtime_error(path + ": could not write the result");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tessera's AdamW over gradients read from a file (for benchmarks/adamw_compare.py)"};
  int64_t size = 0, steps = 0;
  std::string input, output;
  tessera::ops::AdamWParams params;
  app.add_option("--size", size, "Parameters")->required();
  app.add_option("--steps", steps, "Steps (gradients in the file)")->required();
  app.add_option("--input", input, "Initial parameters, then the gradients (f32)")->required();
  app.add_option("--output", output, "Final parameters, exp_avg, exp_avg_sq (f32)")->required();
  app.add_option("--lr", params.lr);
  app.add_option("--beta1", params.beta1);
  app.add_option("--beta2", params.beta2);
  app.add_option("--eps", params.eps);
  app.add_option("--weight-decay", params.weight_decay);
  CLI11_PARSE(app, argc, argv);
  try {
    using tessera::DType;
    using tessera::Shape;
    const std::vector<float> data = read_floats(input, size * (steps + 1));
    tessera::Context ctx;
    const Shape shape{size};
    tessera::Tensor param = ctx.from_vector(shape, std::vector<float>(data.begin(), data.begin() + size));
    tessera::Tensor m = ctx.zeros(shape, DType::f32), v = ctx.zeros(shape, DType::f32);
    for (int64_t s = 1; s <= steps; ++s) {
      const auto first = data.begin() + s * size;
      const tessera::Tensor grad = ctx.from_vector(shape, std::vector<float>(first, first + size));
      params.step = s;
      tessera::ops::adamw_step(param, grad, m, v, params);
    }
    write_tensors(output, {&param, &m, &v});
  } catch (const std::exception& error) {
    std::fprintf(stderr, "adamw_steps: %s\n", error.what());
    return 1;
  }
  return 0;
}
