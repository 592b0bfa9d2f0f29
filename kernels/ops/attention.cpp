// ops:: causal attention over packed qkv [B, T, 3, H, Dh] (the GPT's) and over
// grouped qkv [B, T, G, R + 2, Dh] (grouped-query attention, Llama's):
// argument checks, then the device's backend.
#include "kernels/functors/attention.h"

#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

// The CUDA kernels keep a head's vector in registers, Dh/32 floats per lane.
constexpr int64_t kCudaMaxHeadDim = 256;

enum class QkvKind { packed, grouped };

struct AttentionDims {
  int64_t batch, seq_len, heads, groups, head_dim;
  Shape out() const { return Shape{batch, seq_len, heads, head_dim}; }
  Shape logsumexp() const { return Shape{batch, heads, seq_len}; }
};

AttentionDims check_qkv(std::string_view op, QkvKind kind, const Tensor& qkv) {
  detail::check_floating(op, {"qkv", qkv});
  detail::check_ndim(op, {"qkv", qkv}, 5);
  AttentionDims dims{};
  if (kind == QkvKind::packed) {
    TESSERA_CHECK(qkv.size(2) == 3, op, ": 'qkv' must be [B, T, 3, H, Dh] (query, key, value), got shape ",
                  qkv.shape().to_string());
    dims = AttentionDims{qkv.size(0), qkv.size(1), qkv.size(3), qkv.size(3), qkv.size(4)};
  } else {
    TESSERA_CHECK(qkv.size(3) >= 3, op,
                  ": 'qkv' must be [B, T, G, R + 2, Dh] (per key/value group: R ≥ 1 queries, the key, the value), got "
                  "shape ",
                  qkv.shape().to_string());
    TESSERA_CHECK(qkv.size(2) > 0, op, ": 'qkv' has no key/value groups (shape ", qkv.shape().to_string(), ")");
    dims = AttentionDims{qkv.size(0), qkv.size(1), qkv.size(2) * (qkv.size(3) - 2), qkv.size(2), qkv.size(4)};
  }
  TESSERA_CHECK(dims.head_dim > 0, op, ": 'qkv' has head dimension 0 (shape ", qkv.shape().to_string(), ")");
  if (qkv.device().is_cuda())
    TESSERA_CHECK(dims.head_dim <= kCudaMaxHeadDim, op, ": head dimension ", dims.head_dim,
                  " is larger than the CUDA kernels support (", kCudaMaxHeadDim,
                  "); use more heads of a smaller dimension");
  return dims;
}

void check_output(std::string_view op, std::string_view name, const Tensor& qkv, const Tensor& t, const Shape& shape) {
  detail::check_floating(op, {name, t});
  detail::check_same_dtype(op, {"qkv", qkv}, {name, t});
  detail::check_shape(op, {name, t}, shape);
  TESSERA_CHECK(!detail::overlaps(t, qkv), op, ": '", name, "' must not overlap 'qkv' in memory");
}

void check_forward(std::string_view op, QkvKind kind, const Tensor& qkv, const Tensor& out, const Tensor& logsumexp) {
  const AttentionDims dims = check_qkv(op, kind, qkv);
  check_output(op, "out", qkv, out, dims.out());
  detail::check_dtype(op, {"logsumexp", logsumexp}, DType::f32);
  detail::check_shape(op, {"logsumexp", logsumexp}, dims.logsumexp());
  detail::check_same_device(op, {{"qkv", qkv}, {"out", out}, {"logsumexp", logsumexp}});
}

void check_backward(std::string_view op, QkvKind kind, const Tensor& grad_out, const Tensor& qkv, const Tensor& out,
                    const Tensor& logsumexp, const Tensor& grad_qkv) {
  const AttentionDims dims = check_qkv(op, kind, qkv);
  detail::check_floating(op, {"grad_out", grad_out});
  detail::check_same_dtype(op, {"qkv", qkv}, {"grad_out", grad_out});
  detail::check_shape(op, {"grad_out", grad_out}, dims.out());
  detail::check_floating(op, {"out", out});
  detail::check_same_dtype(op, {"qkv", qkv}, {"out", out});
  detail::check_shape(op, {"out", out}, dims.out());
  detail::check_dtype(op, {"logsumexp", logsumexp}, DType::f32);
  detail::check_shape(op, {"logsumexp", logsumexp}, dims.logsumexp());
  check_output(op, "grad_qkv", qkv, grad_qkv, qkv.shape());
  for (const Tensor* input : {&grad_out, &out, &logsumexp})
    TESSERA_CHECK(!detail::overlaps(grad_qkv, *input), op, ": 'grad_qkv' must not overlap an input in memory");
  detail::check_same_device(
      op, {{"grad_out", grad_out}, {"qkv", qkv}, {"out", out}, {"logsumexp", logsumexp}, {"grad_qkv", grad_qkv}});
}

// p in [0, 1) (1 would drop every probability and divide by zero), a head offset that is an index.
void check_dropout(std::string_view op, const AttentionDropout& dropout) {
  TESSERA_CHECK(dropout.p >= 0.0f && dropout.p < 1.0f, op, ": attention dropout probability must be in [0, 1), got ",
                dropout.p, "; check --attention-dropout");
  TESSERA_CHECK(dropout.head_offset >= 0, op, ": attention dropout head_offset must not be negative, got ",
                dropout.head_offset);
}

// The cache holds one head per key/value group: [B, H, S, Dh] for packed qkv, [B, G, S, Dh] for grouped.
void check_with_cache(std::string_view op, QkvKind kind, const Tensor& qkv, const Tensor& keys, const Tensor& values,
                      int64_t position, const Tensor& out) {
  const AttentionDims dims = check_qkv(op, kind, qkv);
  TESSERA_CHECK(dims.head_dim <= kCachedAttentionMaxHeadDim, op, ": head dimension ", dims.head_dim,
                " is larger than the cached attention supports (", kCachedAttentionMaxHeadDim, ")");
  check_output(op, "out", qkv, out, dims.out());
  const char* cache_heads = kind == QkvKind::packed ? "H" : "G";
  for (const Tensor* cache : {&keys, &values}) {
    const std::string_view name = cache == &keys ? "keys" : "values";
    check_output(op, name, qkv, *cache, cache->shape());
    detail::check_ndim(op, {name, *cache}, 4);
    TESSERA_CHECK(cache->size(0) == dims.batch && cache->size(1) == dims.groups && cache->size(3) == dims.head_dim, op,
                  ": '", name, "' must be [B, ", cache_heads, ", S, Dh] = [", dims.batch, ", ", dims.groups, ", S, ",
                  dims.head_dim, "], got ", cache->shape().to_string());
    TESSERA_CHECK(!detail::overlaps(*cache, out), op, ": '", name, "' must not overlap 'out' in memory");
  }
  detail::check_shape(op, {"values", values}, keys.shape());
  TESSERA_CHECK(!detail::overlaps(keys, values), op, ": 'keys' and 'values' must not overlap in memory");
  TESSERA_CHECK(position >= 0 && position + dims.seq_len <= keys.size(2), op, ": ", dims.seq_len,
                " new tokens at position ", position, " do not fit a cache of ", keys.size(2), " positions");
  detail::check_same_device(op, {{"qkv", qkv}, {"keys", keys}, {"values", values}, {"out", out}});
}

}  // namespace

void attention_forward(const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale,
                       const AttentionDropout& dropout) {
  check_forward("attention_forward", QkvKind::packed, qkv, out, logsumexp);
  check_dropout("attention_forward", dropout);
  backend_for(qkv, "attention_forward").attention_forward(qkv, out, logsumexp, scale, dropout);
}

void attention_backward(const Tensor& grad_out, const Tensor& qkv, const Tensor& out, const Tensor& logsumexp,
                        Tensor& grad_qkv, float scale, const AttentionDropout& dropout) {
  check_backward("attention_backward", QkvKind::packed, grad_out, qkv, out, logsumexp, grad_qkv);
  check_dropout("attention_backward", dropout);
  backend_for(qkv, "attention_backward").attention_backward(grad_out, qkv, out, logsumexp, grad_qkv, scale, dropout);
}

void attention_with_cache(const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position, Tensor& out, float scale) {
  check_with_cache("attention_with_cache", QkvKind::packed, qkv, keys, values, position, out);
  backend_for(qkv, "attention_with_cache").attention_with_cache(qkv, keys, values, position, out, scale);
}

void grouped_attention_forward(const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale,
                               const AttentionDropout& dropout) {
  check_forward("grouped_attention_forward", QkvKind::grouped, qkv, out, logsumexp);
  check_dropout("grouped_attention_forward", dropout);
  backend_for(qkv, "grouped_attention_forward").grouped_attention_forward(qkv, out, logsumexp, scale, dropout);
}

void grouped_attention_backward(const Tensor& grad_out, const Tensor& qkv, const Tensor& out, const Tensor& logsumexp,
                                Tensor& grad_qkv, float scale, const AttentionDropout& dropout) {
  check_backward("grouped_attention_backward", QkvKind::grouped, grad_out, qkv, out, logsumexp, grad_qkv);
  check_dropout("grouped_attention_backward", dropout);
  backend_for(qkv, "grouped_attention_backward")
      .grouped_attention_backward(grad_out, qkv, out, logsumexp, grad_qkv, scale, dropout);
}

void grouped_attention_with_cache(const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position, Tensor& out,
                                  float scale) {
  check_with_cache("grouped_attention_with_cache", QkvKind::grouped, qkv, keys, values, position, out);
  backend_for(qkv, "grouped_attention_with_cache")
      .grouped_attention_with_cache(qkv, keys, values, position, out, scale);
}

}  // namespace tessera::ops
