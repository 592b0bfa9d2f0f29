// The step model and the layout search of `tessera plan` (plan/planner.h).
#include "plan/planner.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <numeric>
#include <set>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "models/registry.h"
#include "parallel/memory_plan.h"
#include "parallel/pipeline.h"
#include "parallel/tensor_parallel.h"
#include "plan/costs.h"

namespace tessera::plan {
namespace {

using parallel::PipelineScheduleKind;

// The shapes one rank sees for one micro-batch of one layer.
struct Shapes {
  int64_t tokens = 0;  // T = b · s / cp: the rank's query tokens
  int64_t seq = 0;     // s: the keys each query attends to (all of them under cp)
  int64_t micro = 1;   // b
  int64_t h = 0, f = 0, heads = 0, groups = 0, head_dim = 0, vocab = 0;
  int64_t experts = 0, topk = 0, expert_ffn = 0;
  int tp = 1, ep = 1;
  int64_t sp_div = 1;  // t under sequence parallelism, else 1
  double e = 2;        // bytes per value
  bool swiglu = false, rotary = false, dropout = false, attention_dropout = false;
};

Shapes shapes_of(const PlanModel& pm, const PlanLayout& l) {
  const nn::ModelConfig& m = pm.model;
  const nn::DecoderChoices d = m.decoder();
  Shapes s;
  s.micro = l.micro_batch;
  s.seq = m.seq_length;
  s.tokens = l.micro_batch * m.seq_length / l.cp;
  s.h = m.hidden_size;
  s.f = m.ffn();
  s.heads = m.num_heads;
  s.groups = m.query_groups();
  s.head_dim = m.hidden_size / m.num_heads;
  s.vocab = m.vocab_size;
  s.experts = m.num_experts;
  s.topk = m.moe_router_topk;
  s.expert_ffn = m.num_experts > 0 ? m.moe_ffn() : 0;
  s.tp = l.tp;
  s.ep = l.ep;
  s.sp_div = l.sequence_parallel ? l.tp : 1;
  s.e = double(dtype_size(pm.dtype));
  s.swiglu = d.swiglu;
  s.rotary = d.rotary;
  s.dropout = m.dropout > 0;
  s.attention_dropout = m.attention_dropout > 0;
  return s;
}

// The groups a rank talks in, by the rank order tp-cp-ep-dp-pp.
struct Groups {
  GroupLink tp, cp, ep, data, experts_data, pipe;
};

Groups groups_of(const Cluster& c, const PlanLayout& l) {
  Groups g;
  g.tp = group_link(c, l.tp, 1);
  g.cp = group_link(c, l.cp, l.tp);
  g.ep = group_link(c, l.ep, l.tp * l.cp);
  g.data = group_link(c, l.dp * l.cp, l.tp);
  g.experts_data = group_link(c, l.dp * l.cp / l.ep, l.tp * l.cp * l.ep);
  g.pipe = group_link(c, l.pp > 1 ? 2 : 1, l.world() / l.pp);
  return g;
}

// One GEMM of a layer: [m×k]·[k×n] forward; its backward's dX [m×k] and dW [k×n].
struct Gemm {
  int64_t m, n, k;
  int64_t count = 1;
};

std::vector<Gemm> layer_gemms(const Shapes& s, bool moe) {
  const int64_t t = s.tp, T = s.tokens;
  std::vector<Gemm> gemms = {{T, (s.heads + 2 * s.groups) * s.head_dim / t, s.h}, {T, s.h, s.heads * s.head_dim / t}};
  if (!moe) {
    gemms.push_back({T, (s.swiglu ? 2 : 1) * s.f / t, s.h});
    gemms.push_back({T, s.h, s.f / t});
    return gemms;
  }
  // Router, then this rank's experts (E / ep of them), each given the
  // average share of the ep group's T·k routed tokens.
  const int64_t local = std::max<int64_t>(1, s.experts / s.ep);
  const int64_t rows = std::max<int64_t>(1, T * s.topk * s.ep / s.experts);
  gemms.push_back({T, s.experts, s.h});
  gemms.push_back({rows, 2 * s.expert_ffn, s.h, local});
  gemms.push_back({rows, s.h, s.expert_ffn, local});
  return gemms;
}

struct Phases {
  double forward = 0, input_gradient = 0, weight_gradient = 0;
  double tp = 0, cp = 0, ep = 0;  // the communication inside them (whole: forward + backward)
};

// The attention core's forward and backward seconds.
std::pair<double, double> attention_seconds(const Accelerator& a, DType dtype, const Shapes& s, AttentionKernel kind) {
  const int64_t batches = s.micro * s.heads / s.tp;
  const int64_t queries = s.tokens / s.micro;
  if (kind == AttentionKernel::fused) {
    const double flops = 4.0 * double(s.tokens) * double(s.seq) * double(s.heads / s.tp * s.head_dim) * 0.5;
    const double forward = flops / (a.peak_flops(dtype) * a.attention_efficiency) + a.launch_seconds;
    return {forward, 2.5 * forward};
  }
  const double scores = double(batches) * double(queries) * double(s.seq);
  const double gemm =
      double(batches) * (gemm_seconds(a, dtype, queries, s.seq, s.head_dim) - a.launch_seconds) + a.launch_seconds;
  const double gemm_av =
      double(batches) * (gemm_seconds(a, dtype, queries, s.head_dim, s.seq) - a.launch_seconds) + a.launch_seconds;
  const double drop = s.attention_dropout ? (2 * s.e + 1) * scores : 0.0;
  const double forward = gemm + gemm_av + memory_seconds(a, 2 * s.e * scores + drop, 2);
  const double backward = 2 * (gemm + gemm_av) + memory_seconds(a, 3 * s.e * scores + drop, 2);
  return {forward, backward};
}

// Bytes the memory-bound kernels of one layer's forward move (norms,
// residual adds, dropouts, activation, rope), and how many kernels.
std::pair<double, int> elementwise_bytes(const Shapes& s, bool moe) {
  const double T = double(s.tokens), h = double(s.h), e = s.e, t = double(s.tp), sp = double(s.sp_div);
  double bytes = 2 * 2 * h * e / sp + 2 * 3 * h * e / sp;  // two norms, two residual adds
  int kernels = 4;
  if (s.dropout) {
    bytes += 2 * (2 * e + 1) * h / sp;
    kernels += 2;
  }
  const double width = moe ? double(s.topk * s.expert_ffn) : double(s.f) / t;
  bytes += (s.swiglu || moe ? 3 : 2) * width * e;
  kernels += 1;
  if (s.rotary) {
    bytes += 2 * double(s.heads + s.groups) * double(s.head_dim) / t * e;
    kernels += 1;
  }
  return {bytes * T, kernels};
}

Phases layer_phases(const PlanModel& pm, const Cluster& c, const PlanLayout& l, const Groups& g, const Shapes& s,
                    bool moe) {
  const Accelerator& a = c.accelerator;
  Phases p;
  double gemm_forward = 0, gemm_dx = 0, gemm_dw = 0;
  for (const Gemm& m : layer_gemms(s, moe)) {
    gemm_forward += double(m.count) * gemm_seconds(a, pm.dtype, m.m, m.n, m.k);
    gemm_dx += double(m.count) * gemm_seconds(a, pm.dtype, m.m, m.k, m.n);
    gemm_dw += double(m.count) * gemm_seconds(a, pm.dtype, m.k, m.n, m.m);
  }
  const auto [attention_forward, attention_backward] = attention_seconds(a, pm.dtype, s, pm.attention);
  const auto [bytes, kernels] = elementwise_bytes(s, moe);
  const double elementwise = memory_seconds(a, bytes, kernels);
  // Two all-reduces (or all-gather + reduce-scatter pairs) per pass under tp.
  const double activation_bytes = double(s.tokens) * double(s.h) * s.e;
  const double tp_pass = 2 * all_reduce_seconds(g.tp, activation_bytes);
  // The ring of K and V blocks beside the attention (twice the bytes backward: dK, dV).
  const double kv_bytes = 2.0 * double(s.tokens) * double(s.groups * s.head_dim / s.tp) * s.e;
  const double ring = l.cp > 1 ? double(l.cp - 1) * send_seconds(group_link(c, 2, l.tp), kv_bytes) : 0.0;
  const double cp_forward = std::max(0.0, ring - attention_forward);
  const double cp_backward = std::max(0.0, 2 * ring - attention_backward);
  const double a2a =
      moe && l.ep > 1 ? 2 * all_to_all_seconds(g.ep, double(s.tokens * s.topk) * double(s.h) * s.e) : 0.0;
  p.forward = gemm_forward + attention_forward + elementwise + tp_pass + cp_forward + a2a;
  p.input_gradient = gemm_dx + attention_backward + 2 * elementwise + tp_pass + cp_backward + a2a;
  p.weight_gradient = gemm_dw;
  const double passes = l.recompute ? 3 : 2;
  p.tp = passes * tp_pass;
  p.cp = cp_forward * (passes - 1) + cp_backward;
  p.ep = passes * a2a;
  if (l.recompute) p.input_gradient += p.forward;
  return p;
}

// The first chunk's embedding and the last chunk's final norm, head and loss.
Phases embedding_phases(const Cluster& c, const Groups& g, const Shapes& s) {
  const Accelerator& a = c.accelerator;
  const double T = double(s.tokens), h = double(s.h);
  Phases p;
  const double lookups = (s.rotary ? 2 : 4) * T * h * s.e / double(s.sp_div);
  p.forward = memory_seconds(a, lookups, 2) + all_reduce_seconds(g.tp, T * h * s.e);
  p.weight_gradient = memory_seconds(a, T * h * (s.e + 4), 1);
  p.tp = all_reduce_seconds(g.tp, T * h * s.e);
  return p;
}

Phases head_phases(const PlanModel& pm, const Cluster& c, const Groups& g, const Shapes& s) {
  const Accelerator& a = c.accelerator;
  const double T = double(s.tokens), h = double(s.h), vocab = double(s.vocab / s.tp);
  Phases p;
  const double logits = T * vocab * 4;  // f32 logits for the loss
  const double tp_in = all_reduce_seconds(g.tp, T * h * s.e);
  p.forward = memory_seconds(a, 4 * h * s.e * T / double(s.sp_div), 1) +
              gemm_seconds(a, pm.dtype, s.tokens, s.vocab / s.tp, s.h) + memory_seconds(a, 3 * logits, 3) +
              (s.tp > 1 ? 2 * all_reduce_seconds(g.tp, T * 4) : 0.0) + (s.sp_div > 1 ? tp_in / 2 : 0.0);
  p.input_gradient =
      memory_seconds(a, 2 * logits, 1) + gemm_seconds(a, pm.dtype, s.tokens, s.h, s.vocab / s.tp) + tp_in;
  p.weight_gradient = gemm_seconds(a, pm.dtype, s.h, s.vocab / s.tp, s.tokens);
  p.tp = tp_in * (s.sp_div > 1 ? 1.5 : 1.0);
  return p;
}

// Bytes one layer keeps for its backward, per micro-batch, and the input
// that full recompute keeps instead.
struct LayerActivations {
  double saved = 0, input = 0;
  double transient = 0;  // what its backward allocates besides: the MLP's hidden gradient(s) and the input's
};

LayerActivations layer_activations(const PlanModel& pm, const Shapes& s, bool moe) {
  const double T = double(s.tokens), h = double(s.h), e = s.e, t = double(s.tp), sp = double(s.sp_div);
  const double heads_t = double(s.heads) / t, dh = double(s.head_dim);
  double bytes = 2 * T * h * e / sp;  // the norms' inputs
  // The column-parallel linears (qkv, the MLP's first) keep their whole input:
  // under sequence parallelism the gathered one, not the rank's shard.
  bytes += T * h * e;                                        // qkv's input
  bytes += T * double(s.heads + 2 * s.groups) * dh / t * e;  // q, k, v
  bytes += T * heads_t * dh * e;                             // attention's output: the projection's input
  if (pm.attention == AttentionKernel::fused) {
    bytes += T * heads_t * 4;  // log-sum-exp per query and head
  } else {
    const double scores = double(s.micro) * heads_t * double(s.tokens / s.micro) * double(s.seq);
    bytes += scores * e + (s.attention_dropout ? scores * (1 + e) : 0.0);  // softmax; dropout mask and output
  }
  if (s.dropout) bytes += 2 * T * h / sp;  // the two dropout masks
  bytes += T * h * e;                      // the MLP's input (gathered under sequence parallelism, as qkv's)
  if (moe) {
    const double routed = T * double(s.topk);
    bytes += T * double(s.experts) * 4 + routed * h * e + routed * 3 * double(s.expert_ffn) * e;
  } else {
    bytes += T * (s.swiglu ? 3 : 2) * double(s.f) / t * e;  // the activation's input(s) and the down projection's
  }
  const double hidden = moe ? double(s.topk * s.expert_ffn) : double(s.f) / t;
  const double transient = T * ((s.swiglu || moe ? 2 : 1) * hidden * e + h * e / sp);
  return {bytes, T * h * e / sp, transient};
}

struct Chunk {
  int64_t begin = 0, end = 0;  // layers
  bool first = false, last = false;
  int stage = 0;
};

std::vector<Chunk> chunks_of(const PlanModel& pm, const PlanLayout& l) {
  const nn::LayerCosts costs = models::layer_costs(pm.model);
  const int count = l.pp * l.vpp;
  const std::vector<int64_t> bounds = count == 1
                                          ? std::vector<int64_t>{0, int64_t(costs.layers.size())}
                                          : parallel::partition_layers(costs.layers, costs.first, costs.last, count);
  const parallel::ChunkMap map{l.pp, l.vpp, parallel::chunk_placement(l.schedule)};
  std::vector<Chunk> chunks;
  for (int g = 0; g < count; ++g)
    chunks.push_back({bounds[size_t(g)], bounds[size_t(g) + 1], g == 0, g + 1 == count, map.stage_of(g)});
  return chunks;
}

// Parameter elements one rank of `stage` holds: its layers' and extras' split
// over tp (norms and routers are whole on every tp rank: small), the experts'
// over ep.
struct StageParameters {
  int64_t dense = 0, experts = 0;
  std::vector<int64_t> units;  // per layer / embedding / head: ZeRO-2/3's sharding units
};

StageParameters stage_parameters(const PlanModel& pm, const PlanLayout& l, const std::vector<Chunk>& chunks,
                                 int stage) {
  const nn::ModelConfig& m = pm.model;
  const nn::LayerCosts costs = models::layer_costs(m);
  const int64_t expert = m.num_experts > 0 ? m.num_experts * 3 * m.moe_ffn() * m.hidden_size : 0;
  StageParameters p;
  for (const Chunk& c : chunks) {
    if (c.stage != stage) continue;
    if (c.first) p.units.push_back(costs.first / l.tp);
    for (int64_t layer = c.begin; layer < c.end; ++layer) {
      const int64_t experts = m.moe_layer(layer) ? expert / l.ep : 0;
      const int64_t dense = (costs.layers[size_t(layer)] - (m.moe_layer(layer) ? expert : 0)) / l.tp;
      p.units.push_back(dense + experts);
      p.experts += experts;
    }
    // A tied head on the stage that holds the embedding uses its table: only the final norm is its own.
    const bool shares_table = !m.untied() && std::any_of(chunks.begin(), chunks.end(), [stage](const Chunk& other) {
      return other.stage == stage && other.first;
    });
    if (c.last) p.units.push_back((costs.last - (shares_table ? m.vocab_size * m.hidden_size : 0)) / l.tp);
  }
  p.dense = std::accumulate(p.units.begin(), p.units.end(), int64_t(0)) - p.experts;
  return p;
}

int64_t micro_batches(const PlanModel& pm, const PlanLayout& l) {
  return pm.global_batch / (l.dp * l.micro_batch);
}

// Per model chunk costs for the simulator, and each stage's own work.
struct PipelineInput {
  parallel::PipelineCosts costs;
  std::vector<Phases> chunk;  // per model chunk
};

PipelineInput pipeline_input(const PlanModel& pm, const Cluster& c, const PlanLayout& l, const Groups& g,
                             const Shapes& s, const std::vector<Chunk>& chunks) {
  const Phases dense = layer_phases(pm, c, l, g, s, false);
  const Phases moe = pm.model.num_experts > 0 ? layer_phases(pm, c, l, g, s, true) : dense;
  const Phases embedding = embedding_phases(c, g, s), head = head_phases(pm, c, g, s);
  PipelineInput in;
  for (const Chunk& ch : chunks) {
    Phases sum;
    const auto add = [&sum](const Phases& p) {
      sum.forward += p.forward;
      sum.input_gradient += p.input_gradient;
      sum.weight_gradient += p.weight_gradient;
      sum.tp += p.tp;
      sum.cp += p.cp;
      sum.ep += p.ep;
    };
    if (ch.first) add(embedding);
    for (int64_t layer = ch.begin; layer < ch.end; ++layer) add(pm.model.moe_layer(layer) ? moe : dense);
    if (ch.last) add(head);
    in.chunk.push_back(sum);
    in.costs.forward.push_back(sum.forward);
    in.costs.input_gradient.push_back(sum.input_gradient);
    in.costs.weight_gradient.push_back(sum.weight_gradient);
    in.costs.backward.push_back(sum.input_gradient + sum.weight_gradient);
  }
  const double sent = double(s.tokens) * double(s.h) * s.e / double(s.sp_div);
  in.costs.transfer = send_seconds(g.pipe, sent);
  return in;
}

// The pipeline's span: simulated, or by the schedule's closed form.
struct Span {
  double span = 0, busiest_work = 0;
  int busiest = 0;
  std::vector<int> in_flight;  // per stage, units (micro-batch, chunk) holding activations at once
};

Span pipeline_span(const PipelineInput& in, const PlanLayout& l, int64_t m, bool simulate) {
  const int p = l.pp;
  std::vector<double> work(size_t(p), 0.0);
  const parallel::ChunkMap map{p, l.vpp, parallel::chunk_placement(l.schedule)};
  for (size_t g = 0; g < in.chunk.size(); ++g)
    work[size_t(map.stage_of(int(g)))] +=
        double(m) * (in.chunk[g].forward + in.chunk[g].input_gradient + in.chunk[g].weight_gradient);
  Span out;
  out.busiest = int(std::max_element(work.begin(), work.end()) - work.begin());
  out.busiest_work = work[size_t(out.busiest)];
  if (p == 1) {
    out.span = out.busiest_work;
    out.in_flight = {1};
    return out;
  }
  if (simulate) {
    std::vector<std::vector<parallel::PipeInstruction>> lists;
    for (int st = 0; st < p; ++st) lists.push_back(parallel::pipeline_schedule(l.schedule, p, st, int(m), l.vpp));
    const parallel::PipelineSimulation sim =
        parallel::simulate_pipeline(lists, int(m), parallel::chunk_placement(l.schedule), in.costs);
    TESSERA_CHECK(sim.completed, "plan: the ", parallel::pipeline_schedule_name(l.schedule),
                  " schedule did not complete in simulation: ", sim.problem);
    out.span = sim.span();
    out.in_flight = parallel::splits_backward(l.schedule) ? sim.max_awaiting_weight : sim.max_in_flight;
    return out;
  }
  // Closed forms: the busiest stage's work plus the warm-up and cool-down it waits through.
  double unit = 0, weight = 0;
  for (const Phases& c : in.chunk) {
    unit += c.forward + c.input_gradient + c.weight_gradient;
    weight += c.weight_gradient;
  }
  unit /= double(in.chunk.size());
  weight /= double(in.chunk.size());
  double bubble = double(p - 1) * (unit + 2 * in.costs.transfer);
  if (l.schedule == PipelineScheduleKind::zb_h1) bubble = double(p - 1) * (unit - 2 * weight + 2 * in.costs.transfer);
  if (l.schedule == PipelineScheduleKind::zbv) bubble = double(p - 1) * std::max(0.0, unit - 2 * weight);
  out.span = out.busiest_work + bubble;
  for (int st = 0; st < p; ++st) {
    int units = int(std::min<int64_t>(p - st, m));
    if (l.schedule == PipelineScheduleKind::gpipe) units = int(m);
    if (l.vpp > 1) units = int(std::min<int64_t>(2 * (p - st - 1) + (l.vpp - 1) * p + 1, m * l.vpp));
    if (l.schedule == PipelineScheduleKind::zbv) units = int(std::min<int64_t>(2 * p, 2 * m));
    out.in_flight.push_back(units);
  }
  return out;
}

MemoryUse stage_memory(const PlanModel& pm, const PlanLayout& l, const Shapes& s, const std::vector<Chunk>& chunks,
                       const Span& span, int stage, int64_t m) {
  const StageParameters params = stage_parameters(pm, l, chunks, stage);
  parallel::MemoryPlanInput in;
  in.unit_elements = params.units;
  in.value_bytes = int64_t(s.e);
  in.optimizer_bytes = parallel::optimizer_bytes_per_element(pm.optimizer, pm.dtype);
  in.data_parallel = l.dp * l.cp;
  in.zero_stage = l.zero;
  in.accumulates = m > 1;
  const parallel::MemoryPlan state = parallel::predict_memory(in);
  MemoryUse use;
  use.stage = stage;
  use.parameters = state.parameters;
  use.gradients = state.gradients * pm.gradient_bytes / 4;
  use.optimizer = state.optimizer;
  int64_t layers = 0, chunk_count = 0;
  bool last = false;
  double moe_share = 0;
  for (const Chunk& c : chunks)
    if (c.stage == stage) {
      layers += c.end - c.begin;
      ++chunk_count;
      last = last || c.last;
      for (int64_t layer = c.begin; layer < c.end; ++layer) moe_share += pm.model.moe_layer(layer) ? 1 : 0;
    }
  const LayerActivations dense = layer_activations(pm, s, false), moe = layer_activations(pm, s, true);
  const double per_layer =
      layers > 0 ? ((double(layers) - moe_share) * dense.saved + moe_share * moe.saved) / double(layers) : 0.0;
  const double layers_per_unit = chunk_count > 0 ? double(layers) / double(chunk_count) : 0.0;
  const double units = span.in_flight.empty() ? 1.0 : double(span.in_flight[size_t(stage)]);
  const double transient = std::max(dense.transient, moe_share > 0 ? moe.transient : 0.0);
  use.activations = l.recompute ? int64_t(units * layers_per_unit * dense.input + per_layer + transient)
                                : int64_t(units * layers_per_unit * per_layer + transient);
  if (last) use.logits = int64_t(2.0 * double(s.tokens) * double(s.vocab / s.tp) * 4);
  return use;
}

// The data-parallel reduction, ZeRO's gathers and the optimizer step of the busiest stage's rank.
void add_data_parallel(const PlanModel& pm, const Cluster& c, const PlanLayout& l, const Groups& g,
                       const StageParameters& params, double last_backward, double micro_work, int64_t m, StepTime& t) {
  const double e = double(dtype_size(pm.dtype)), gb = double(pm.gradient_bytes);
  const double dense = double(params.dense), experts = double(params.experts);
  const bool sharded = l.zero >= 1;
  const double reduce =
      sharded ? reduce_scatter_seconds(g.data, gb * dense) + reduce_scatter_seconds(g.experts_data, gb * experts)
              : all_reduce_seconds(g.data, gb * dense) + all_reduce_seconds(g.experts_data, gb * experts);
  const double total_bytes = gb * (dense + experts);
  const double bucket = std::min(1.0, 25.0 * 1024 * 1024 / std::max(1.0, total_bytes)) * reduce;
  const double gather = reduce_scatter_seconds(g.data, e * dense) + reduce_scatter_seconds(g.experts_data, e * experts);
  if (l.zero <= 1) {
    t.data_parallel = std::max(bucket, reduce - last_backward);
    if (l.zero == 1) t.zero = gather;
  } else if (l.zero == 2) {
    t.data_parallel = std::max(bucket, reduce - last_backward) + double(m - 1) * std::max(0.0, reduce - last_backward);
    t.zero = gather;
  } else {
    const double per_micro = 2 * gather + reduce;
    const double units = double(std::max<size_t>(1, params.units.size()));
    t.data_parallel = 0;
    t.zero = double(m) * std::max(0.0, per_micro - micro_work) + gather / units;
  }
  if (l.dp * l.cp == 1) t.data_parallel = t.zero = 0;
  // The optimizer: gradient read, f32 master and moments read and written, the value written.
  const double local = (dense + experts) / (sharded ? double(l.dp * l.cp) : 1.0);
  const double state = double(parallel::optimizer_bytes_per_element(pm.optimizer, pm.dtype));
  const double master = pm.dtype == DType::f32 ? 2 * e : 8.0 + e;
  t.optimizer = memory_seconds(
      c.accelerator, local * (gb + master + 2 * state) + gb * (dense + experts) / (sharded ? double(l.dp * l.cp) : 1.0),
      4);
}

}  // namespace

std::string PlanLayout::describe() const {
  std::ostringstream out;
  out << "dp " << dp << " tp " << tp << " pp " << pp;
  if (cp > 1) out << " cp " << cp;
  if (ep > 1) out << " ep " << ep;
  if (pp > 1) {
    out << " " << parallel::pipeline_schedule_name(schedule);
    if (vpp > 1 && schedule != PipelineScheduleKind::zbv) out << " vpp " << vpp;
  }
  out << " zero " << zero << " mbs " << micro_batch;
  if (recompute) out << " recompute";
  if (sequence_parallel) out << " sp";
  return out.str();
}

std::string PlanLayout::flags() const {
  std::ostringstream out;
  out << "--tp " << tp << " --pp " << pp;
  if (cp > 1) out << " --cp " << cp;
  if (ep > 1) out << " --ep " << ep;
  if (pp > 1) out << " --pipeline-schedule " << parallel::pipeline_schedule_name(schedule);
  if (vpp > 1 && schedule != PipelineScheduleKind::zbv) out << " --virtual-pipeline-stages " << vpp;
  out << " --zero " << zero << " --micro-batch-size " << micro_batch;
  if (recompute) out << " --recompute";
  if (sequence_parallel) out << " --sequence-parallel";
  return out.str();
}

std::string layout_problem(const PlanModel& pm, const Cluster& c, const PlanLayout& l) {
  const nn::ModelConfig& m = pm.model;
  std::ostringstream why;
  if (!nn::model_traits(m.kind).reads_tokens) return "tessera plan models the language models (--model gpt, llama)";
  if (l.world() != c.world())
    why << "dp " << l.dp << " x tp " << l.tp << " x pp " << l.pp << " x cp " << l.cp << " = " << l.world()
        << " ranks, but the cluster has " << c.world();
  else if (const std::string tp = parallel::tensor_parallel_problem(m, l.tp, l.sequence_parallel); !tp.empty())
    why << tp;
  else if (l.sequence_parallel && l.tp == 1)
    why << "--sequence-parallel needs --tp > 1";
  else if (l.cp > 1 && m.seq_length % (2 * l.cp))
    why << "--cp " << l.cp << ": --seq-length " << m.seq_length << " is not a multiple of 2 x cp (the zigzag split)";
  else if (l.pp * l.vpp > m.num_layers)
    why << "--pp " << l.pp << " x " << l.vpp << " chunks is more than the " << m.num_layers << " layers";
  else if (l.ep > 1 && (m.num_experts == 0 || l.dp % l.ep || m.num_experts % l.ep))
    why << "--ep " << l.ep << " must divide the data-parallel size " << l.dp << " and --num-experts " << m.num_experts;
  else if (l.micro_batch < 1 || pm.global_batch % (int64_t(l.dp) * l.micro_batch))
    why << "--global-batch-size " << pm.global_batch << " is not a multiple of dp " << l.dp << " x --micro-batch-size "
        << l.micro_batch;
  else if (l.zero < 0 || l.zero > 3)
    why << "--zero " << l.zero << " is not 0-3";
  if (!why.str().empty()) return why.str();
  if (l.pp > 1) {
    try {
      parallel::pipeline_schedule(l.schedule, l.pp, 0, int(micro_batches(pm, l)), l.vpp);
    } catch (const std::exception& error) {
      return error.what();
    }
  } else if (l.vpp != 1) {
    return "--virtual-pipeline-stages needs --pp > 1";
  }
  return {};
}

double step_flops(const PlanModel& pm, bool recompute) {
  const nn::ModelConfig& m = pm.model;
  const double tokens = double(pm.global_batch) * double(m.seq_length);
  const double h = double(m.hidden_size), dh = h / double(m.num_heads);
  const double attention_params = double(m.num_heads + 2 * m.query_groups()) * dh * h + h * h;
  const double dense_mlp = (m.decoder().swiglu ? 3.0 : 2.0) * double(m.ffn()) * h;
  const double moe_mlp = double(m.num_experts) * h + double(m.moe_router_topk) * 3.0 * double(m.moe_ffn()) * h;
  double layers = 0;
  for (int64_t layer = 0; layer < m.num_layers; ++layer)
    layers += 2 * (attention_params + (m.moe_layer(layer) ? moe_mlp : dense_mlp)) * tokens +
              4 * tokens * double(m.seq_length) * h;
  const double head = 2 * tokens * h * double(m.vocab_size);
  return (recompute ? 4 : 3) * layers + 3 * head;
}

double zero_paper_model_state_bytes(double psi, int nd, int stage, double k) {
  const double n = nd;
  switch (stage) {
    case 0:
      return (2 + 2 + k) * psi;
    case 1:
      return 2 * psi + 2 * psi + k * psi / n;
    case 2:
      return 2 * psi + (2 + k) * psi / n;
    default:
      return (2 + 2 + k) * psi / n;
  }
}

Prediction predict(const PlanModel& pm, const Cluster& c, const PlanLayout& l, bool simulate) {
  const std::string problem = layout_problem(pm, c, l);
  TESSERA_CHECK(problem.empty(), "plan: ", l.describe(), ": ", problem);
  const Shapes s = shapes_of(pm, l);
  const Groups g = groups_of(c, l);
  const std::vector<Chunk> chunks = chunks_of(pm, l);
  const int64_t m = micro_batches(pm, l);
  const PipelineInput in = pipeline_input(pm, c, l, g, s, chunks);
  const Span span = pipeline_span(in, l, m, simulate);
  Prediction p;
  p.layout = l;
  p.simulated = simulate || l.pp == 1;
  // The busiest stage's parts.
  double tp = 0, cp = 0, ep = 0, last_backward = 0, micro_work = 0;
  const parallel::ChunkMap map{l.pp, l.vpp, parallel::chunk_placement(l.schedule)};
  for (size_t ch = 0; ch < in.chunk.size(); ++ch) {
    if (map.stage_of(int(ch)) != span.busiest) continue;
    const Phases& ph = in.chunk[ch];
    tp += double(m) * ph.tp;
    cp += double(m) * ph.cp;
    ep += double(m) * ph.ep;
    last_backward += ph.input_gradient + ph.weight_gradient;
    micro_work += ph.forward + ph.input_gradient + ph.weight_gradient;
  }
  StepTime& t = p.time;
  t.tensor_parallel = tp;
  t.context_parallel = cp;
  t.expert_parallel = ep;
  t.compute = span.busiest_work - tp - cp - ep;
  t.pipeline_bubble = span.span - span.busiest_work;
  const StageParameters params = stage_parameters(pm, l, chunks, span.busiest);
  add_data_parallel(pm, c, l, g, params, last_backward, micro_work, m, t);
  t.step = span.span + t.data_parallel + t.zero + t.optimizer;
  // Memory: the fullest stage.
  for (int stage = 0; stage < l.pp; ++stage) {
    const MemoryUse use = stage_memory(pm, l, s, chunks, span, stage, m);
    p.stages.push_back(use);
    if (stage == 0 || use.total() > p.memory.total()) p.memory = use;
  }
  p.fits = double(p.memory.total()) <= kUsableMemory * double(c.accelerator.memory_bytes);
  p.model_flops = step_flops(pm, false);
  p.hardware_flops = step_flops(pm, l.recompute);
  const double world = double(l.world());
  p.tokens_per_s = double(pm.global_batch * pm.model.seq_length) / t.step;
  p.tflops_per_gpu = p.hardware_flops / t.step / world / 1e12;
  p.mfu = p.model_flops / t.step / world / c.accelerator.peak_flops(pm.dtype);
  return p;
}

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

template <typename T>
std::vector<T> choices(const std::optional<T>& fixed, std::vector<T> all) {
  return fixed ? std::vector<T>{*fixed} : all;
}

// The pipeline variants for P stages: 1F1B, interleaved (V = 2, 4), ZB-H1, ZBV.
std::vector<std::pair<PipelineScheduleKind, int>> schedules(const SearchLimits& lim, int pp) {
  if (pp == 1) return {{PipelineScheduleKind::one_f_one_b, 1}};
  std::vector<std::pair<PipelineScheduleKind, int>> all = {
      {PipelineScheduleKind::one_f_one_b, 1}, {PipelineScheduleKind::one_f_one_b, 2},
      {PipelineScheduleKind::one_f_one_b, 4}, {PipelineScheduleKind::zb_h1, 1},
      {PipelineScheduleKind::zbv, 2},         {PipelineScheduleKind::gpipe, 1}};
  std::vector<std::pair<PipelineScheduleKind, int>> out;
  for (const auto& [kind, v] : all) {
    if (lim.schedule && *lim.schedule != kind) continue;
    if (lim.vpp && *lim.vpp != v) continue;
    if (!lim.schedule && kind == PipelineScheduleKind::gpipe) continue;  // never better than 1F1B
    out.emplace_back(kind, v);
  }
  return out;
}

}  // namespace

namespace {

// Every combination of the axes `lim` leaves free for the cluster's world.
std::vector<PlanLayout> candidate_layouts(const PlanModel& pm, const Cluster& c, const SearchLimits& lim) {
  const int world = c.world();
  std::vector<PlanLayout> out;
  for (const int tp : choices<int>(lim.tp, divisors(std::min(world, c.per_node))))
    for (const int cp : choices<int>(lim.cp, {1, 2, 4, 8}))
      for (const int pp : choices<int>(lim.pp, divisors(world)))
        if (world % (tp * cp * pp) == 0)
          for (const int ep : choices<int>(lim.ep, divisors(world / (tp * cp * pp))))
            for (const auto& [kind, v] : schedules(lim, pp))
              for (const int zero : choices<int>(lim.zero, {0, 1, 2, 3}))
                for (const int64_t mbs : choices<int64_t>(lim.micro_batch, {1, 2, 4, 8, 16}))
                  for (const bool recompute : choices<bool>(lim.recompute, {false, true})) {
                    PlanLayout l;
                    l.tp = tp;
                    l.cp = cp;
                    l.pp = pp;
                    l.dp = world / (tp * cp * pp);
                    l.ep = ep;
                    l.schedule = kind;
                    l.vpp = v;
                    l.zero = zero;
                    l.micro_batch = mbs;
                    l.recompute = recompute;
                    l.sequence_parallel = lim.sequence_parallel.value_or(tp > 1);
                    if (ep > 1 && pm.model.num_experts == 0) continue;
                    if (zero > 0 && l.dp * l.cp == 1 && !lim.zero) continue;
                    out.push_back(l);
                  }
  return out;
}

// Faster first; among layouts within 0.1 % of the fastest of their run, the
// simpler first (fewer split axes, lower ZeRO stage, smaller cp, pp, tp).
void rank_by_time(std::vector<Prediction>& list) {
  const auto simplicity = [](const PlanLayout& l) {
    const int axes = (l.cp > 1) + (l.pp > 1) + (l.ep > 1) + (l.tp > 1) + (l.vpp > 1) + (l.recompute ? 1 : 0);
    return std::make_tuple(axes, l.zero, l.cp, l.pp, l.vpp, l.tp, l.ep);
  };
  std::stable_sort(list.begin(), list.end(),
                   [](const Prediction& a, const Prediction& b) { return a.time.step < b.time.step; });
  for (size_t i = 0; i < list.size();) {
    size_t j = i + 1;
    while (j < list.size() && list[j].time.step <= list[i].time.step * (1 + 1e-3)) ++j;
    std::stable_sort(
        list.begin() + std::ptrdiff_t(i), list.begin() + std::ptrdiff_t(j),
        [&](const Prediction& a, const Prediction& b) { return simplicity(a.layout) < simplicity(b.layout); });
    i = j;
  }
}

}  // namespace

SearchResult search_layouts(const PlanModel& pm, const Cluster& c, const SearchLimits& lim, int simulate_top,
                            const std::function<void(int64_t, int64_t)>& progress) {
  SearchResult result;
  std::set<std::string> reasons;
  std::vector<Prediction> fitting;
  const std::vector<PlanLayout> candidates = candidate_layouts(pm, c, lim);
  result.considered = int64_t(candidates.size());
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (progress && i % 2000 == 0) progress(int64_t(i), int64_t(candidates.size()));
    const std::string why = layout_problem(pm, c, candidates[i]);
    if (!why.empty()) {
      ++result.refused;
      if (reasons.size() < 6) reasons.insert(why);
      continue;
    }
    Prediction p = predict(pm, c, candidates[i], /*simulate=*/false);
    if (p.fits) {
      fitting.push_back(std::move(p));
      continue;
    }
    ++result.too_big;
    if (!result.smallest || p.memory.total() < result.smallest->memory.total()) result.smallest = p;
  }
  rank_by_time(fitting);
  // The fastest by the closed form, simulated with the real schedules, ranked again.
  const size_t top = std::min(fitting.size(), size_t(std::max(0, simulate_top)));
  std::vector<Prediction> simulated;
  for (size_t i = 0; i < top; ++i) {
    Prediction p = predict(pm, c, fitting[i].layout, /*simulate=*/true);
    if (p.fits) simulated.push_back(std::move(p));
  }
  rank_by_time(simulated);
  simulated.insert(simulated.end(), std::make_move_iterator(fitting.begin() + std::ptrdiff_t(top)),
                   std::make_move_iterator(fitting.end()));
  result.ranked = std::move(simulated);
  result.refusals.assign(reasons.begin(), reasons.end());
  return result;
}

}  // namespace tessera::plan
