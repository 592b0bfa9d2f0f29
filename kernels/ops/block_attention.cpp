// ops:: blockwise causal attention with global positions (context
// parallelism's ring, see ops.h): argument checks, then the device's backend.
// Every message names the operator and the argument, and the shape expected.
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/validate.h"

namespace tessera::ops {
namespace {

// The CUDA kernels keep a head's vector in registers, Dh/32 floats per lane;
// the CPU runs the same row functors with the whole vector in one lane.
constexpr int64_t kMaxHeadDim = 256;

struct BlockDims {
  int64_t batch, queries, keys, heads, groups, head_dim;
  Shape out() const { return Shape{batch, queries, heads, head_dim}; }
  Shape logsumexp() const { return Shape{batch, heads, queries}; }
  Shape kv() const { return Shape{batch, keys, groups, 2, head_dim}; }
};

BlockDims check_inputs(std::string_view op, const Tensor& q, const Tensor& kv, const Tensor& q_positions,
                       const Tensor& k_positions) {
  detail::check_floating(op, {"q", q});
  detail::check_ndim(op, {"q", q}, 4);
  detail::check_ndim(op, {"kv", kv}, 5);
  detail::check_same_dtype(op, {"q", q}, {"kv", kv});
  TESSERA_CHECK(kv.size(3) == 2, op, ": 'kv' must be [B, Tk, G, 2, Dh] (per key/value head its key and value), got ",
                kv.shape().to_string());
  const BlockDims dims{q.size(0), q.size(1), kv.size(1), q.size(2), kv.size(2), q.size(3)};
  TESSERA_CHECK(kv.size(0) == dims.batch && kv.size(4) == dims.head_dim, op, ": 'kv' ", kv.shape().to_string(),
                " does not match 'q' ", q.shape().to_string(), " in batch or head dimension");
  TESSERA_CHECK(dims.groups > 0 && dims.heads % dims.groups == 0, op, ": ", dims.heads,
                " query heads do not split into ", dims.groups, " key/value heads; check --num-query-groups");
  TESSERA_CHECK(dims.head_dim > 0 && dims.head_dim <= kMaxHeadDim, op, ": head dimension ", dims.head_dim,
                " is outside [1, ", kMaxHeadDim, "]; use more heads of a smaller dimension");
  detail::check_dtype(op, {"q_positions", q_positions}, DType::i64);
  detail::check_shape(op, {"q_positions", q_positions}, Shape{dims.queries});
  detail::check_dtype(op, {"k_positions", k_positions}, DType::i64);
  detail::check_shape(op, {"k_positions", k_positions}, Shape{dims.keys});
  return dims;
}

void check_f32_output(std::string_view op, std::string_view name, const Tensor& t, const Shape& shape,
                      std::initializer_list<const Tensor*> inputs) {
  detail::check_dtype(op, {name, t}, DType::f32);
  detail::check_shape(op, {name, t}, shape);
  for (const Tensor* input : inputs)
    TESSERA_CHECK(!detail::overlaps(t, *input), op, ": '", name, "' must not overlap an input in memory");
}

}  // namespace

void attention_block_forward(const Tensor& q, const Tensor& kv, const Tensor& q_positions, const Tensor& k_positions,
                             Tensor& out, Tensor& logsumexp, float scale) {
  constexpr std::string_view op = "attention_block_forward";
  const BlockDims dims = check_inputs(op, q, kv, q_positions, k_positions);
  check_f32_output(op, "out", out, dims.out(), {&q, &kv, &q_positions, &k_positions});
  check_f32_output(op, "logsumexp", logsumexp, dims.logsumexp(), {&q, &kv, &q_positions, &k_positions, &out});
  detail::check_same_device(op, {{"q", q},
                                 {"kv", kv},
                                 {"q_positions", q_positions},
                                 {"k_positions", k_positions},
                                 {"out", out},
                                 {"logsumexp", logsumexp}});
  backend_for(q, "attention_block_forward")
      .attention_block_forward(q, kv, q_positions, k_positions, out, logsumexp, scale);
}

void attention_block_merge(const Tensor& block_out, const Tensor& block_logsumexp, Tensor& out, Tensor& logsumexp) {
  constexpr std::string_view op = "attention_block_merge";
  detail::check_ndim(op, {"out", out}, 4);
  const Shape stats{out.size(0), out.size(2), out.size(1)};
  check_f32_output(op, "out", out, out.shape(), {&block_out, &block_logsumexp});
  check_f32_output(op, "logsumexp", logsumexp, stats, {&block_out, &block_logsumexp, &out});
  detail::check_dtype(op, {"block_out", block_out}, DType::f32);
  detail::check_shape(op, {"block_out", block_out}, out.shape());
  detail::check_dtype(op, {"block_logsumexp", block_logsumexp}, DType::f32);
  detail::check_shape(op, {"block_logsumexp", block_logsumexp}, stats);
  detail::check_same_device(
      op, {{"block_out", block_out}, {"block_logsumexp", block_logsumexp}, {"out", out}, {"logsumexp", logsumexp}});
  backend_for(out, "attention_block_merge").attention_block_merge(block_out, block_logsumexp, out, logsumexp);
}

void attention_block_backward(const Tensor& grad_out, const Tensor& q, const Tensor& kv, const Tensor& out,
                              const Tensor& logsumexp, const Tensor& q_positions, const Tensor& k_positions,
                              Tensor& grad_q, Tensor& grad_kv, float scale) {
  constexpr std::string_view op = "attention_block_backward";
  const BlockDims dims = check_inputs(op, q, kv, q_positions, k_positions);
  for (const detail::Arg arg : {detail::Arg{"grad_out", grad_out}, detail::Arg{"out", out}}) {
    detail::check_same_dtype(op, {"q", q}, arg);
    detail::check_shape(op, arg, dims.out());
  }
  detail::check_dtype(op, {"logsumexp", logsumexp}, DType::f32);
  detail::check_shape(op, {"logsumexp", logsumexp}, dims.logsumexp());
  const std::initializer_list<const Tensor*> inputs{&grad_out, &q, &kv, &out, &logsumexp, &q_positions, &k_positions};
  check_f32_output(op, "grad_q", grad_q, dims.out(), inputs);
  check_f32_output(op, "grad_kv", grad_kv, dims.kv(), inputs);
  TESSERA_CHECK(!detail::overlaps(grad_q, grad_kv), op, ": 'grad_q' and 'grad_kv' must not overlap in memory");
  detail::check_same_device(op, {{"grad_out", grad_out},
                                 {"q", q},
                                 {"kv", kv},
                                 {"out", out},
                                 {"logsumexp", logsumexp},
                                 {"q_positions", q_positions},
                                 {"k_positions", k_positions},
                                 {"grad_q", grad_q},
                                 {"grad_kv", grad_kv}});
  backend_for(q, "attention_block_backward")
      .attention_block_backward(grad_out, q, kv, out, logsumexp, q_positions, k_positions, grad_q, grad_kv, scale);
}

}  // namespace tessera::ops
