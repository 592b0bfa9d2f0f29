// ops:: causal attention over packed qkv: argument checks, then the device's backend.
#include "kernels/functors/attention.h"

#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

// The CUDA kernels keep a head's vector in registers, Dh/32 floats per lane.
constexpr int64_t kCudaMaxHeadDim = 256;

struct AttentionDims {
  int64_t batch, seq_len, heads, head_dim;
  Shape out() const { return Shape{batch, seq_len, heads, head_dim}; }
  Shape logsumexp() const { return Shape{batch, heads, seq_len}; }
};

AttentionDims check_qkv(std::string_view op, const Tensor& qkv) {
  detail::check_floating(op, {"qkv", qkv});
  detail::check_ndim(op, {"qkv", qkv}, 5);
  TESSERA_CHECK(qkv.size(2) == 3, op, ": 'qkv' must be [B, T, 3, H, Dh] (query, key, value), got shape ",
                qkv.shape().to_string());
  const AttentionDims dims{qkv.size(0), qkv.size(1), qkv.size(3), qkv.size(4)};
  TESSERA_CHECK(dims.head_dim > 0, op, ": 'qkv' has head dimension 0 (shape ", qkv.shape().to_string(), ")");
  if (qkv.device().is_cuda())
    TESSERA_CHECK(dims.head_dim <= kCudaMaxHeadDim, op, ": head dimension ", dims.head_dim,
                  " is larger than the CUDA kernels support (", kCudaMaxHeadDim,
                  "); use more heads of a smaller dimension");
  return dims;
}

// True when the two tensors' bytes overlap (views of one storage may not).
bool overlaps(const Tensor& a, const Tensor& b) {
  if (!a.shares_storage_with(b)) return false;
  return a.offset_bytes() < b.offset_bytes() + b.nbytes() && b.offset_bytes() < a.offset_bytes() + a.nbytes();
}

void check_output(std::string_view op, std::string_view name, const Tensor& qkv, const Tensor& t, const Shape& shape) {
  detail::check_floating(op, {name, t});
  detail::check_same_dtype(op, {"qkv", qkv}, {name, t});
  detail::check_shape(op, {name, t}, shape);
  TESSERA_CHECK(!overlaps(t, qkv), op, ": '", name, "' must not overlap 'qkv' in memory");
}

}  // namespace

void attention_forward(const Tensor& qkv, Tensor& out, Tensor& logsumexp, float scale) {
  constexpr std::string_view op = "attention_forward";
  const AttentionDims dims = check_qkv(op, qkv);
  check_output(op, "out", qkv, out, dims.out());
  detail::check_dtype(op, {"logsumexp", logsumexp}, DType::f32);
  detail::check_shape(op, {"logsumexp", logsumexp}, dims.logsumexp());
  detail::check_same_device(op, {{"qkv", qkv}, {"out", out}, {"logsumexp", logsumexp}});
  backend_for(qkv, "attention_forward").attention_forward(qkv, out, logsumexp, scale);
}

void attention_backward(const Tensor& grad_out, const Tensor& qkv, const Tensor& out, const Tensor& logsumexp,
                        Tensor& grad_qkv, float scale) {
  constexpr std::string_view op = "attention_backward";
  const AttentionDims dims = check_qkv(op, qkv);
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
    TESSERA_CHECK(!overlaps(grad_qkv, *input), op, ": 'grad_qkv' must not overlap an input in memory");
  detail::check_same_device(
      op, {{"grad_out", grad_out}, {"qkv", qkv}, {"out", out}, {"logsumexp", logsumexp}, {"grad_qkv", grad_qkv}});
  backend_for(qkv, "attention_backward").attention_backward(grad_out, qkv, out, logsumexp, grad_qkv, scale);
}

void attention_with_cache(const Tensor& qkv, Tensor& keys, Tensor& values, int64_t position, Tensor& out, float scale) {
  constexpr std::string_view op = "attention_with_cache";
  const AttentionDims dims = check_qkv(op, qkv);
  TESSERA_CHECK(dims.head_dim <= kCachedAttentionMaxHeadDim, op, ": head dimension ", dims.head_dim,
                " is larger than the cached attention supports (", kCachedAttentionMaxHeadDim, ")");
  check_output(op, "out", qkv, out, dims.out());
  for (Tensor* cache : {&keys, &values}) {
    const std::string_view name = cache == &keys ? "keys" : "values";
    check_output(op, name, qkv, *cache, cache->shape());
    detail::check_ndim(op, {name, *cache}, 4);
    TESSERA_CHECK(cache->size(0) == dims.batch && cache->size(1) == dims.heads && cache->size(3) == dims.head_dim, op,
                  ": '", name, "' must be [B, H, S, Dh] = [", dims.batch, ", ", dims.heads, ", S, ", dims.head_dim,
                  "], got ", cache->shape().to_string());
    TESSERA_CHECK(!overlaps(*cache, out), op, ": '", name, "' must not overlap 'out' in memory");
  }
  detail::check_shape(op, {"values", values}, keys.shape());
  TESSERA_CHECK(!overlaps(keys, values), op, ": 'keys' and 'values' must not overlap in memory");
  TESSERA_CHECK(position >= 0 && position + dims.seq_len <= keys.size(2), op, ": ", dims.seq_len,
                " new tokens at position ", position, " do not fit a cache of ", keys.size(2), " positions");
  detail::check_same_device(op, {{"qkv", qkv}, {"keys", keys}, {"values", values}, {"out", out}});
  backend_for(qkv, "attention_with_cache").attention_with_cache(qkv, keys, values, position, out, scale);
}

}  // namespace tessera::ops
