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
    : stage_(stage), pipeline_(pipeline), loss_(loss), options_(std::move(options)) {}

int64_t PipelineEngine::now() const {
  if (options_.clock) return options_.clock();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

PipelineStepStats PipelineEngine::run(const PipelineStep& step) {
  const int s = stage(), p = stages(), m = step.micro_batches;
  const bool first = s == 0, last = s + 1 == p;
  TESSERA_CHECK(m >= 1, "pipeline: a step needs at least one micro-batch");
  TESSERA_CHECK(!first || int(step.inputs.size()) == m, "pipeline stage 0: ", step.inputs.size(), " inputs for ", m,
                " micro-batches");
  TESSERA_CHECK(!last || int(step.targets.size()) == m, "pipeline stage ", s, ": ", step.targets.size(),
                " targets for ", m, " micro-batches");
  Context& ctx = stage_.context();
  const Device device = stage_.spec().device;
  std::vector<nn::Saved> saved(static_cast<size_t>(m)), loss_saved(static_cast<size_t>(m));
  std::vector<Tensor> received(static_cast<size_t>(m)), outputs(static_cast<size_t>(m));
  std::vector<Tensor> grads_in(static_cast<size_t>(m)), grads_out(static_cast<size_t>(m));
  std::vector<Shape> output_shapes(static_cast<size_t>(m));
  PipelineStepStats stats;
  stats.start_ns = now();
  int in_flight = 0;
  const auto event = [&](const std::string& name, const std::string& category, int64_t start) {
    const int64_t end = now();
    if (options_.on_event) options_.on_event(name, category, start, end);
    return end - start;
  };

  for (const PipeInstruction& in : pipeline_schedule(options_.schedule, p, s, m)) {
    const int64_t start = now();
    const size_t i = size_t(in.micro);
    if (in.op == PipeInstruction::Op::forward) {
      const Tensor& input = first ? step.inputs[i] : received[i];
      TESSERA_CHECK(input.defined(), "pipeline stage ", s, ": forward of micro-batch ", in.micro, " without its input");
      outputs[i] = stage_.forward(input, saved[i], step.pass ? step.pass(in.micro) : nn::Pass{});
      received[i] = Tensor();  // what the stage needs is in saved[i]
      output_shapes[i] = outputs[i].shape();
      if (last) stats.loss_sum += loss_.forward(outputs[i], step.targets[i], loss_saved[i]).loss;
      stats.max_in_flight = std::max(stats.max_in_flight, ++in_flight);
      stats.compute_ns += event("forward " + std::to_string(in.micro), "compute", start);
    } else if (in.op == PipeInstruction::Op::backward) {
      if (step.before_backward) step.before_backward(in.micro);
      Tensor grad;
      if (last) {
        Tensor logits = outputs[i];
        loss_.backward(logits, step.targets[i], step.loss_scale / float(m), loss_saved[i]);
        grad = stage_.backward(logits, saved[i]);
        outputs[i] = Tensor();
      } else {
        TESSERA_CHECK(grads_in[i].defined(), "pipeline stage ", s, ": backward of micro-batch ", in.micro,
                      " without its gradient");
        grad = stage_.backward(grads_in[i], saved[i]);
        grads_in[i] = Tensor();
      }
      saved[i].clear();  // the micro-batch's activations go as soon as its backward is done
      if (!first) grads_out[i] = grad;
      --in_flight;
      stats.compute_ns += event("backward " + std::to_string(in.micro), "compute", start);
    } else {
      std::vector<P2POp> ops;
      for (const PipeTransfer& t : in.transfers) {
        const size_t k = size_t(t.micro);
        switch (t.kind) {
          case PipeTransfer::Kind::send_activation:
            ops.push_back({P2POp::Kind::send, outputs[k], s + 1});
            break;
          case PipeTransfer::Kind::recv_activation:
            received[k] = ctx.empty(step.input_shape, step.activation_dtype, device);
            ops.push_back({P2POp::Kind::recv, received[k], s - 1});
            break;
          case PipeTransfer::Kind::send_gradient:
            ops.push_back({P2POp::Kind::send, grads_out[k], s - 1});
            break;
          case PipeTransfer::Kind::recv_gradient:
            grads_in[k] = ctx.empty(output_shapes[k], step.activation_dtype, device);
            ops.push_back({P2POp::Kind::recv, grads_in[k], s + 1});
            break;
        }
      }
      pipeline_.send_recv(ops)->wait();
      for (const PipeTransfer& t : in.transfers) {
        if (t.kind == PipeTransfer::Kind::send_activation) outputs[size_t(t.micro)] = Tensor();
        if (t.kind == PipeTransfer::Kind::send_gradient) grads_out[size_t(t.micro)] = Tensor();
      }
      event("p2p", "comm", start);
    }
  }
  stats.end_ns = now();
  return stats;
}

Tensor PipelineEngine::forward_only(const Tensor& input, const Shape& input_shape, DType activation_dtype,
                                    const nn::Pass& pass) {
  const int s = stage(), p = stages();
  Tensor x = input;
  if (s > 0) {
    x = stage_.context().empty(input_shape, activation_dtype, stage_.spec().device);
    pipeline_.recv(x, s - 1)->wait();
  }
  nn::Saved saved;
  Tensor y = stage_.forward(x, saved, pass);
  if (s + 1 == p) return y;
  pipeline_.send(y, s + 1)->wait();
  return Tensor();
}

}  // namespace tessera::parallel
