// Parameter helpers: the name hash that keys initialisation (FNV-1a, 64 bit),
// shard geometry (runs of consecutive elements) and shard initialisation, and
// zeroing of gradients at the start of an optimizer step.
#include "nn/parameter.h"

#include "core/error.h"

namespace tessera::nn {

uint64_t name_stream(const std::string& name) {
  constexpr uint64_t kOffsetBasis = 0xcbf29ce484222325ull, kPrime = 0x100000001b3ull;
  uint64_t hash = kOffsetBasis;
  for (const char c : name) {
    hash ^= uint64_t(static_cast<unsigned char>(c));
    hash *= kPrime;
  }
  return hash;
}

int64_t ParameterShard::local_numel() const {
  if (!split) return global_shape.numel();
  const Shape& cut = cut_shape();
  return cut.numel() / cut[dim] * length;
}

std::vector<ShardRun> shard_runs(const ParameterShard& shard) {
  if (!shard.split) return {ShardRun{0, 0, shard.global_shape.numel()}};
  const Shape& cut = shard.cut_shape();
  TESSERA_CHECK(cut.numel() == shard.global_shape.numel(), "shard view ", cut.to_string(), " does not hold the ",
                shard.global_shape.numel(), " elements of ", shard.global_shape.to_string());
  TESSERA_CHECK(shard.dim >= 0 && shard.dim < cut.ndim() && shard.begin >= 0 && shard.length >= 0 &&
                    shard.begin + shard.length <= cut[shard.dim],
                "shard [", shard.begin, ", ", shard.begin + shard.length, ") of dimension ", shard.dim,
                " is outside view ", cut.to_string());
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < shard.dim; ++d) outer *= cut[d];
  for (int d = shard.dim + 1; d < cut.ndim(); ++d) inner *= cut[d];
  const int64_t size = cut[shard.dim], run = shard.length * inner;
  std::vector<ShardRun> runs;
  for (int64_t o = 0; o < outer; ++o) {
    const ShardRun next{(o * size + shard.begin) * inner, o * run, run};
    if (!runs.empty() && runs.back().global_offset + runs.back().count == next.global_offset)
      runs.back().count += next.count;  // contiguous with the previous run (e.g. the whole dimension)
    else if (run > 0)
      runs.push_back(next);
  }
  return runs;
}

void init_shard_normal(Parameter& p, uint64_t seed, float mean, float stddev) {
  Tensor flat = p.value.flatten();
  for (const ShardRun& r : shard_runs(p.shard))
    flat.slice(r.local_offset, r.local_offset + r.count)
        .normal_at_(seed, name_stream(p.name), uint64_t(r.global_offset), mean, stddev);
}

void init_shard_uniform(Parameter& p, uint64_t seed, float low, float high) {
  Tensor flat = p.value.flatten();
  for (const ShardRun& r : shard_runs(p.shard))
    flat.slice(r.local_offset, r.local_offset + r.count)
        .uniform_at_(seed, name_stream(p.name), uint64_t(r.global_offset), low, high);
}

void zero_grads(const std::vector<Parameter*>& parameters) {
  for (Parameter* p : parameters)
    if (p->grad.defined()) p->grad.fill_(0.0);
}

}  // namespace tessera::nn
