// Mixture-of-experts layer benchmark: parallel::MixtureOfExperts (router,
// top-k, dispatch, SwiGLU experts on contiguous rows, combine) forward and
// backward on the CPU for --tokens tokens of --hidden features, --experts
// experts of --ffn features, top --top-k, f32 and bf16. Each figure is the
// median of --repeats timed runs after one warm-up. benchmarks/moe_compare.py
// runs PyTorch eager's equivalent (Hugging Face Mixtral's loop over experts)
// beside it. Prints machine-readable lines:
//   moe_layer omp_threads=2
//   moe_layer tokens=2048 dtype=f32 forward_seconds=0.031 backward_seconds=0.070
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/context.h"
#include "parallel/moe.h"

namespace tessera {
namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

Tensor random(Context& ctx, const Shape& shape, DType dtype, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  std::vector<double> values(static_cast<size_t>(shape.numel()));
  for (double& v : values) v = unit(rng);
  return ctx.from_doubles(shape, dtype, values);
}

struct Sizes {
  int64_t tokens, hidden, experts, ffn, top_k;
};

// Median seconds of the layer's forward, and of its backward, over `repeats` runs after one warm-up.
void bench(Context& ctx, const Sizes& s, DType dtype, int repeats) {
  nn::ModelSpec spec;
  spec.context = &ctx;
  spec.dtype = dtype;
  spec.seed = 11;
  parallel::MoeConfig config;
  config.num_experts = s.experts;
  config.top_k = s.top_k;
  config.ffn_hidden = s.ffn;
  config.aux_loss_coeff = 1e-2;
  parallel::MixtureOfExperts moe(spec, "moe", s.hidden, config, 0.0f);
  std::mt19937_64 rng(7);
  const Tensor x = random(ctx, Shape{1, s.tokens, s.hidden}, dtype, rng);
  const Tensor g = random(ctx, x.shape(), dtype, rng);
  std::vector<double> forward, backward;
  for (int i = 0; i <= repeats; ++i) {
    nn::Saved saved;
    const auto start = Clock::now();
    moe.forward(x, saved, nn::Pass{});
    const auto middle = Clock::now();
    moe.backward(g, saved);
    const auto end = Clock::now();
    if (i == 0) continue;  // the warm-up
    forward.push_back(std::chrono::duration<double>(middle - start).count());
    backward.push_back(std::chrono::duration<double>(end - middle).count());
  }
  std::printf(
      "moe_layer tokens=%lld hidden=%lld experts=%lld ffn=%lld top_k=%lld dtype=%s forward_seconds=%.5f "
      "backward_seconds=%.5f\n",
      static_cast<long long>(s.tokens), static_cast<long long>(s.hidden), static_cast<long long>(s.experts),
      static_cast<long long>(s.ffn), static_cast<long long>(s.top_k), std::string(dtype_name(dtype)).c_str(),
      median(forward), median(backward));
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  CLI::App app{"the mixture-of-experts layer's forward and backward on the CPU"};
  tessera::Sizes s{2048, 512, 8, 1024, 2};
  std::vector<std::string> dtypes{"f32", "bf16"};
  int repeats = 5;
  app.add_option("--tokens", s.tokens, "tokens N");
  app.add_option("--hidden", s.hidden, "hidden size C");
  app.add_option("--experts", s.experts, "experts E");
  app.add_option("--ffn", s.ffn, "each expert's SwiGLU width F");
  app.add_option("--top-k", s.top_k, "experts per token K");
  app.add_option("--dtypes", dtypes, "dtypes (f32, bf16, f16)");
  app.add_option("--repeats", repeats, "timed runs per figure (the median is printed)")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  std::printf("moe_layer omp_threads=%d\n", omp_get_max_threads());
  tessera::Context ctx;
  for (const std::string& name : dtypes) tessera::bench(ctx, s, tessera::parse_dtype(name), repeats);
  return 0;
}
