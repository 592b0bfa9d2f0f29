// Stage partitioning (balanced or --pipeline-split) and the PipelineEngine
// that interprets a schedule on one stage: forwards, backwards, the loss on
// the last stage, and grouped activation/gradient exchanges with the
// neighbours.
#include "parallel/pipeline.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <sstream>

#include "core/context.h"

namespace tessera::parallel {

std::vector<int64_t> partition_layers(const std::vector<int64_t>& costs, int64_t first_extra, int64_t last_extra,
                                      int stages) {
  const int64_t layers = int64_t(costs.size());
  TESSERA_CHECK(stages >= 1, "--pipeline-parallel ", stages, " must be at least 1");
  TESSERA_CHECK(layers >= stages, "--pipeline-parallel ", stages, " needs at least one layer per stage, the model has ",
                layers, "; use at most ", layers, " stages (or more layers)");
  std::vector<int64_t> prefix(size_t(layers) + 1, 0);
  for (int64_t i = 0; i < layers; ++i) prefix[size_t(i) + 1] = prefix[size_t(i)] + costs[size_t(i)];
  const auto cost = [&](int stage, int64_t begin, int64_t end) {
    return prefix[size_t(end)] - prefix[size_t(begin)] + (stage == 0 ? first_extra : 0) +
           (stage == stages - 1 ? last_extra : 0);
  };
  // best[s][e]: the smallest largest-stage cost of stages 0..s over layers [0, e).
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> best(size_t(stages), std::vector<int64_t>(size_t(layers) + 1, kNone));
  std::vector<std::vector<int64_t>> cut(size_t(stages), std::vector<int64_t>(size_t(layers) + 1, 0));
  for (int64_t e = 1; e <= layers; ++e) best[0][size_t(e)] = cost(0, 0, e);
  for (int s = 1; s < stages; ++s)
    for (int64_t e = s + 1; e <= layers; ++e)
      for (int64_t b = s; b < e; ++b) {  // stage s holds [b, e)
        if (best[size_t(s) - 1][size_t(b)] == kNone) continue;
        const int64_t worst = std::max(best[size_t(s) - 1][size_t(b)], cost(s, b, e));
        // Ties: prefer the later cut, which leaves the first stage (which also embeds) lighter.
        if (worst <= best[size_t(s)][size_t(e)]) {
          best[size_t(s)][size_t(e)] = worst;
          cut[size_t(s)][size_t(e)] = b;
        }
      }
  std::vector<int64_t> bounds(size_t(stages) + 1, 0);
  bounds[size_t(stages)] = layers;
  for (int s = stages - 1; s >= 1; --s) bounds[size_t(s)] = cut[size_t(s)][size_t(bounds[size_t(s) + 1])];
  return bounds;
}

std::vector<int64_t> parse_pipeline_split(std::string_view text, int64_t layers, int stages) {
  std::vector<int64_t> bounds;
  std::string item;
  std::istringstream in{std::string(text)};
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    int64_t value = -1;
    try {
      value = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TESSERA_CHECK(used == item.size() && !item.empty(), "--pipeline-split '", text, "': '", item,
                  "' is not a layer index; give stage boundaries like 0,5,9,12");
    bounds.push_back(value);
  }
  TESSERA_CHECK(int64_t(bounds.size()) == int64_t(stages) + 1, "--pipeline-split '", text, "' gives ", bounds.size(),
                " boundaries; ", stages, " stages need ", stages + 1, " (0, the first layer of each ",
                "later stage, and ", layers, ")");
  TESSERA_CHECK(bounds.front() == 0 && bounds.back() == layers, "--pipeline-split '", text,
                "' must start at 0 and end at the model's ", layers, " layers");
  for (size_t i = 1; i < bounds.size(); ++i)
    TESSERA_CHECK(bounds[i] > bounds[i - 1], "--pipeline-split '", text, "': stage ", i - 1, " would hold layers [",
                  bounds[i - 1], ", ", bounds[i], "); every stage needs at least one layer");
  return bounds;
}

// ---------------------------------------------------------------------------
// PipelineEngine
// ---------------------------------------------------------------------------
PipelineEngine::PipelineEngine(nn::Module& stage, Communicator& pipeline, const nn::Loss& loss, PipelineOptions options)
    : PipelineEngine(std::vector<nn::Module*>{&stage}, pipeline, loss, std::move(options)) {}

PipelineEngine::PipelineEngine(std::vector<nn::Module*> chunks, Communicator& pipeline, const nn::Loss& loss,
                               PipelineOptions options)
    : chunks_(std::move(chunks)), pipeline_(pipeline), loss_(loss), options_(std::move(options)) {
  TESSERA_CHECK(!chunks_.empty(), "pipeline: a stage needs at least one chunk of the model");
  for (const nn::Module* chunk : chunks_) TESSERA_CHECK(chunk != nullptr, "pipeline: a null model chunk was passed");
}

int64_t PipelineEngine::now() const {
  if (options_.clock) return options_.clock();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace {

// What a stage keeps per unit (micro-batch, chunk) between the schedule's instructions.
struct UnitState {
  nn::Saved saved, loss_saved;
  Tensor received, output, grad_in, grad_out;
  Shape output_shape;
};

}  // namespace

PipelineStepStats PipelineEngine::run(const PipelineStep& step) {
  const int s = stage(), p = stages(), m = step.micro_batches, v = chunks();
  TESSERA_CHECK(m >= 1, "pipeline: a step needs at least one micro-batch");
  TESSERA_CHECK(s != 0 || int(step.inputs.size()) == m, "pipeline stage 0: ", step.inputs.size(), " inputs for ", m,
                " micro-batches");
  TESSERA_CHECK(s + 1 != p || int(step.targets.size()) == m, "pipeline stage ", s, ": ", step.targets.size(),
                " targets for ", m, " micro-batches");
  // The model's first chunk reads the data; its last computes the loss.
  const auto first_chunk = [s](int chunk) { return s == 0 && chunk == 0; };
  const auto last_chunk = [s, p, v](int chunk) { return s + 1 == p && chunk + 1 == v; };
  Context& ctx = chunks_.front()->context();
  const Device device = chunks_.front()->spec().device;
  std::vector<UnitState> units(size_t(m) * size_t(v));
  const auto unit = [&units, m](int micro, int chunk) -> UnitState& {
    return units[size_t(chunk) * size_t(m) + size_t(micro)];
  };
  const std::vector<PipeInstruction> schedule = pipeline_schedule(options_.schedule, p, s, m, v);
  size_t last_backward = 0;
  for (size_t k = 0; k < schedule.size(); ++k)
    if (schedule[k].op == PipeInstruction::Op::backward) last_backward = k;
  PipelineStepStats stats;
  stats.start_ns = now();
  int in_flight = 0;
  const auto event = [&](const std::string& name, const std::string& category, int64_t start) {
    const int64_t end = now();
    if (options_.on_event) options_.on_event(name, category, start, end);
    return end - start;
  };
  const auto unit_name = [v](const char* what, const PipeInstruction& in) {
    return std::string(what) + " " + std::to_string(in.micro) + (v > 1 ? " chunk " + std::to_string(in.chunk) : "");
  };

  for (size_t k = 0; k < schedule.size(); ++k) {
    const PipeInstruction& in = schedule[k];
    const int64_t start = now();
    if (in.op == PipeInstruction::Op::forward) {
      UnitState& u = unit(in.micro, in.chunk);
      const Tensor& input = first_chunk(in.chunk) ? step.inputs[size_t(in.micro)] : u.received;
      TESSERA_CHECK(input.defined(), "pipeline stage ", s, ": forward of micro-batch ", in.micro, " without its input");
      u.output = chunks_[size_t(in.chunk)]->forward(input, u.saved, step.pass ? step.pass(in.micro) : nn::Pass{});
      u.received = Tensor();  // what the chunk needs is in saved
      u.output_shape = u.output.shape();
      if (last_chunk(in.chunk))
        stats.loss_sum += loss_.forward(u.output, step.targets[size_t(in.micro)], u.loss_saved).loss;
      stats.max_in_flight = std::max(stats.max_in_flight, ++in_flight);
      stats.compute_ns += event(unit_name("forward", in), "compute", start);
    } else if (in.op == PipeInstruction::Op::backward) {
      UnitState& u = unit(in.micro, in.chunk);
      if (step.before_backward) step.before_backward(in.micro, k == last_backward);
      nn::Module& chunk = *chunks_[size_t(in.chunk)];
      Tensor grad;
      if (last_chunk(in.chunk)) {
        Tensor logits = u.output;
        loss_.backward(logits, step.targets[size_t(in.micro)], step.loss_scale / float(m), u.loss_saved);
        grad = chunk.backward(logits, u.saved);
        u.output = Tensor();
      } else {
        TESSERA_CHECK(u.grad_in.defined(), "pipeline stage ", s, ": backward of micro-batch ", in.micro,
                      " without its gradient");
        grad = chunk.backward(u.grad_in, u.saved);
        u.grad_in = Tensor();
      }
      u.saved.clear();  // the unit's activations go as soon as its backward is done
      if (!first_chunk(in.chunk)) u.grad_out = grad;
      --in_flight;
      stats.compute_ns += event(unit_name("backward", in), "compute", start);
    } else {
      std::vector<P2POp> ops;
      for (const PipeTransfer& t : in.transfers) {
        UnitState& u = unit(t.micro, t.chunk);
        const int peer = t.peer;
        switch (t.kind) {
          case PipeTransfer::Kind::send_activation:
            ops.push_back({P2POp::Kind::send, u.output, peer});
            break;
          case PipeTransfer::Kind::recv_activation:
            u.received = ctx.empty(step.input_shape, step.activation_dtype, device);
            ops.push_back({P2POp::Kind::recv, u.received, peer});
            break;
          case PipeTransfer::Kind::send_gradient:
            ops.push_back({P2POp::Kind::send, u.grad_out, peer});
            break;
          case PipeTransfer::Kind::recv_gradient:
            u.grad_in = ctx.empty(u.output_shape, step.activation_dtype, device);
            ops.push_back({P2POp::Kind::recv, u.grad_in, peer});
            break;
        }
      }
      pipeline_.send_recv(ops)->wait();
      for (const PipeTransfer& t : in.transfers) {
        UnitState& u = unit(t.micro, t.chunk);
        if (t.kind == PipeTransfer::Kind::send_activation) u.output = Tensor();
        if (t.kind == PipeTransfer::Kind::send_gradient) u.grad_out = Tensor();
      }
      event("p2p", "comm", start);
    }
  }
  stats.end_ns = now();
  return stats;
}

// Chunk by chunk round the ring: local chunk c of every stage, then c + 1.
Tensor PipelineEngine::forward_only(const Tensor& input, const Shape& input_shape, DType activation_dtype,
                                    const nn::Pass& pass) {
  const int s = stage(), p = stages(), v = chunks();
  Tensor x;
  for (int c = 0; c < v; ++c) {
    nn::Module& chunk = *chunks_[size_t(c)];
    if (s == 0 && c == 0) {
      x = input;
    } else {
      x = chunk.context().empty(input_shape, activation_dtype, chunk.spec().device);
      pipeline_.recv(x, (s + p - 1) % p)->wait();
    }
    nn::Saved saved;
    Tensor y = chunk.forward(x, saved, pass);
    if (s + 1 == p && c + 1 == v) return y;
    pipeline_.send(y, (s + 1) % p)->wait();
  }
  return Tensor();
}

}  // namespace tessera::parallel
