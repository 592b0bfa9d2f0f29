// Stage partitioning (balanced or --pipeline-split) and the PipelineEngine
// that interprets a schedule on one stage: forwards, backwards, the loss on
// the last stage, and grouped activation/gradient exchanges with the
// neighbours.
#include "parallel/pipeline.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <optional>
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
  nn::WeightGradients weights;  // a split backward's W step, from its B step
  // The exchanges (indices into StepRun's in-flight list) bringing `received`
  // and `grad_in`, awaited before the forward or backward that reads them.
  std::optional<size_t> activation_exchange, gradient_exchange;
};

// An exchange posted and not yet awaited, with the tensors it sends (kept
// alive until it completes).
struct ExchangeInFlight {
  CommHandle handle;
  std::vector<Tensor> sent;
  bool done = false;
};

// Sets a chunk's module deferring its weight gradients into `later` for a
// scope (the B step of a split backward), and back to one-call backward.
class DeferredWeightGradients {
 public:
  DeferredWeightGradients(nn::Module& chunk, nn::WeightGradients* later) : chunk_(chunk) {
    if (later) chunk_.defer_weight_gradients(later);
  }
  ~DeferredWeightGradients() { chunk_.defer_weight_gradients(nullptr); }
  DeferredWeightGradients(const DeferredWeightGradients&) = delete;
  DeferredWeightGradients& operator=(const DeferredWeightGradients&) = delete;

 private:
  nn::Module& chunk_;
};

size_t last_index_of(const std::vector<PipeInstruction>& schedule, PipeInstruction::Op op) {
  size_t last = 0;
  for (size_t k = 0; k < schedule.size(); ++k)
    if (schedule[k].op == op) last = k;
  return last;
}

}  // namespace

// One step's run of the schedule on this stage: its units' state and the
// instructions' meaning.
class PipelineEngine::StepRun {
 public:
  StepRun(PipelineEngine& engine, const PipelineStep& step)
      : engine_(engine),
        step_(step),
        s_(engine.stage()),
        m_(step.micro_batches),
        map_{engine.stages(), engine.chunks(), chunk_placement(engine.options_.schedule)},
        halves_(splits_backward(engine.options_.schedule)),
        units_(size_t(step.micro_batches) * size_t(engine.chunks())),
        schedule_(pipeline_schedule(engine.options_.schedule, engine.stages(), s_, m_, engine.chunks())),
        // Gradients are complete after the stage's last backward, or its last W step.
        completing_(last_index_of(schedule_, halves_ ? PipeInstruction::Op::weight : PipeInstruction::Op::backward)) {}

  PipelineStepStats run() {
    stats_.start_ns = engine_.now();
    for (size_t k = 0; k < schedule_.size(); ++k) {
      const PipeInstruction& in = schedule_[k];
      progress_exchanges();
      await_inputs(in);
      const int64_t start = engine_.now();
      switch (in.op) {
        case PipeInstruction::Op::forward:
          forward(in);
          stats_.compute_ns += event(unit_name("forward", in), "compute", start);
          break;
        case PipeInstruction::Op::backward:
          backward(in, k);
          stats_.compute_ns += event(unit_name("backward", in), "compute", start);
          break;
        case PipeInstruction::Op::weight:
          weight(in, k);
          stats_.compute_ns += event(unit_name("weight", in), "compute", start);
          break;
        case PipeInstruction::Op::exchange:
          exchange(in);
          event("p2p", "comm", start);  // posting it
          break;
      }
    }
    const int64_t start = engine_.now();
    for (size_t e = 0; e < exchanges_.size(); ++e) await_exchange(e);
    event("p2p wait", "comm", start);
    stats_.end_ns = engine_.now();
    return stats_;
  }

 private:
  UnitState& unit(int micro, int chunk) { return units_[size_t(chunk) * size_t(m_) + size_t(micro)]; }
  // The model's first chunk reads the data; its last computes the loss.
  bool first_chunk(int chunk) const { return map_.model_chunk(s_, chunk) == 0; }
  bool last_chunk(int chunk) const { return map_.model_chunk(s_, chunk) + 1 == map_.model_chunks(); }
  // The local chunk of this stage the model's chunk `offset` after `chunk` is (-1: another stage's).
  int local_neighbour(int chunk, int offset) const {
    const int model_chunk = map_.model_chunk(s_, chunk) + offset;
    if (model_chunk < 0 || model_chunk >= map_.model_chunks() || map_.stage_of(model_chunk) != s_) return -1;
    return map_.local_of(model_chunk);
  }

  void forward(const PipeInstruction& in) {
    UnitState& u = unit(in.micro, in.chunk);
    const Tensor& input = first_chunk(in.chunk) ? step_.inputs[size_t(in.micro)] : u.received;
    TESSERA_CHECK(input.defined(), "pipeline stage ", s_, ": forward of micro-batch ", in.micro, " without its input");
    u.output =
        engine_.chunks_[size_t(in.chunk)]->forward(input, u.saved, step_.pass ? step_.pass(in.micro) : nn::Pass{});
    u.received = Tensor();  // what the chunk needs is in saved
    u.output_shape = u.output.shape();
    if (last_chunk(in.chunk))
      stats_.loss_sum += engine_.loss_.forward(u.output, step_.targets[size_t(in.micro)], u.loss_saved).loss;
    if (const int next = local_neighbour(in.chunk, 1); next >= 0) {  // the next chunk is here (a V's turn)
      unit(in.micro, next).received = u.output;
      u.output = Tensor();
    }
    stats_.max_in_flight = std::max(stats_.max_in_flight, ++in_flight_);
  }

  void backward(const PipeInstruction& in, size_t k) {
    UnitState& u = unit(in.micro, in.chunk);
    if (!halves_ && step_.before_backward) step_.before_backward(in.micro, k == completing_);
    nn::Module& chunk = *engine_.chunks_[size_t(in.chunk)];
    Tensor grad;
    {
      const DeferredWeightGradients deferred(chunk, halves_ ? &u.weights : nullptr);
      if (last_chunk(in.chunk)) {
        Tensor logits = u.output;
        engine_.loss_.backward(logits, step_.targets[size_t(in.micro)], step_.loss_scale / float(m_), u.loss_saved);
        grad = chunk.backward(logits, u.saved);
        u.output = Tensor();
      } else {
        TESSERA_CHECK(u.grad_in.defined(), "pipeline stage ", s_, ": backward of micro-batch ", in.micro,
                      " without its gradient");
        grad = chunk.backward(u.grad_in, u.saved);
        u.grad_in = Tensor();
      }
    }
    u.saved.clear();  // the unit's activations go as soon as its backward is done
    if (!first_chunk(in.chunk)) {
      if (const int previous = local_neighbour(in.chunk, -1); previous >= 0)
        unit(in.micro, previous).grad_in = grad;
      else
        u.grad_out = grad;
    }
    --in_flight_;
  }

  void weight(const PipeInstruction& in, size_t k) {
    UnitState& u = unit(in.micro, in.chunk);
    if (step_.before_backward) step_.before_backward(in.micro, k == completing_);
    u.weights.run();
  }

  // Posts the exchange's transfers, one group per neighbour (in ascending
  // stage order: every stage takes its pairs of stages in one global order,
  // so no groups wait on each other in a cycle, even where each group runs
  // only after the one before, as NCCL's do on a stream). Every stage posts
  // its exchanges in the schedule's order, so they match.
  //
  // The hand-laid exchanges of gpipe, 1f1b and interleaving pair each send
  // with the receive the next instruction needs: awaited at once (waiting on
  // the sends there keeps MPI moving them while the stage is in its call).
  // The zero-bubble schedules' exchanges are laid out at unit costs: awaited
  // where a received tensor is read (the rest at the step's end), so a stage
  // never waits for a neighbour while it has work that does not need that
  // neighbour's data (the W steps fill exactly those gaps), nor for one
  // neighbour because the other is late.
  void exchange(const PipeInstruction& in) {
    std::map<int, std::vector<const PipeTransfer*>> by_peer;
    for (const PipeTransfer& t : in.transfers) by_peer[t.peer].push_back(&t);
    const size_t first = exchanges_.size();
    for (const auto& [peer, transfers] : by_peer) post_group(transfers);
    if (!halves_)
      for (size_t e = first; e < exchanges_.size(); ++e) await_exchange(e);
  }

  void post_group(const std::vector<const PipeTransfer*>& transfers) {
    Context& ctx = engine_.chunks_.front()->context();
    const Device device = engine_.chunks_.front()->spec().device;
    const size_t index = exchanges_.size();
    ExchangeInFlight posted;
    std::vector<P2POp> ops;
    for (const PipeTransfer* t : transfers) {
      UnitState& u = unit(t->micro, t->chunk);
      if (t->is_send()) {  // the unit's output or input gradient, kept alive until the group completes
        Tensor& sent = t->is_activation() ? u.output : u.grad_out;
        ops.push_back({P2POp::Kind::send, sent, t->peer});
        posted.sent.push_back(std::move(sent));
        sent = Tensor();
      } else if (t->is_activation()) {
        u.received = ctx.empty(step_.input_shape, step_.activation_dtype, device);
        ops.push_back({P2POp::Kind::recv, u.received, t->peer});
        u.activation_exchange = index;
      } else {
        u.grad_in = ctx.empty(u.output_shape, step_.activation_dtype, device);
        ops.push_back({P2POp::Kind::recv, u.grad_in, t->peer});
        u.gradient_exchange = index;
      }
    }
    posted.handle = engine_.pipeline_.send_recv(ops);
    exchanges_.push_back(std::move(posted));
  }

  // Before a forward or backward: the exchange bringing its input or
  // gradient, if it is still in flight (the wait is traced as communication).
  void await_inputs(const PipeInstruction& in) {
    if (in.op != PipeInstruction::Op::forward && in.op != PipeInstruction::Op::backward) return;
    UnitState& u = unit(in.micro, in.chunk);
    std::optional<size_t>& arriving =
        in.op == PipeInstruction::Op::forward ? u.activation_exchange : u.gradient_exchange;
    if (!arriving) return;
    const size_t index = *arriving;
    arriving.reset();
    if (exchanges_[index].done) return;
    const int64_t start = engine_.now();
    await_exchange(index);
    event("p2p wait", "comm", start);
  }

  void await_exchange(size_t index) {
    ExchangeInFlight& exchange = exchanges_[index];
    if (exchange.done) return;
    exchange.handle->wait();
    exchange.done = true;
    exchange.sent.clear();
  }

  // Lets the exchanges in flight make progress (MPI moves large messages
  // only inside its calls), freeing what completed ones sent.
  void progress_exchanges() {
    for (ExchangeInFlight& exchange : exchanges_)
      if (!exchange.done && exchange.handle->test()) {
        exchange.done = true;
        exchange.sent.clear();
      }
  }

  int64_t event(const std::string& name, const std::string& category, int64_t start) {
    const int64_t end = engine_.now();
    if (engine_.options_.on_event) engine_.options_.on_event(name, category, start, end);
    return end - start;
  }
  std::string unit_name(const char* what, const PipeInstruction& in) const {
    return std::string(what) + " " + std::to_string(in.micro) +
           (engine_.chunks() > 1 ? " chunk " + std::to_string(in.chunk) : "");
  }

  PipelineEngine& engine_;
  const PipelineStep& step_;
  const int s_, m_;
  const ChunkMap map_;
  const bool halves_;
  std::vector<UnitState> units_;
  const std::vector<PipeInstruction> schedule_;
  const size_t completing_;
  PipelineStepStats stats_;
  int in_flight_ = 0;
  std::vector<ExchangeInFlight> exchanges_;
};

PipelineStepStats PipelineEngine::run(const PipelineStep& step) {
  const int s = stage(), p = stages(), m = step.micro_batches;
  TESSERA_CHECK(m >= 1, "pipeline: a step needs at least one micro-batch");
  const ChunkMap map{p, chunks(), chunk_placement(options_.schedule)};
  bool reads_data = false, computes_loss = false;
  for (int c = 0; c < chunks(); ++c) {
    reads_data = reads_data || map.model_chunk(s, c) == 0;
    computes_loss = computes_loss || map.model_chunk(s, c) + 1 == map.model_chunks();
  }
  TESSERA_CHECK(!reads_data || int(step.inputs.size()) == m, "pipeline stage ", s, ": ", step.inputs.size(),
                " inputs for ", m, " micro-batches");
  TESSERA_CHECK(!computes_loss || int(step.targets.size()) == m, "pipeline stage ", s, ": ", step.targets.size(),
                " targets for ", m, " micro-batches");
  return StepRun(*this, step).run();
}

// The model's chunks in order, each on its stage: the input from the
// previous chunk (on this stage, or received from its stage), the output to
// the next (kept, or sent).
Tensor PipelineEngine::forward_only(const Tensor& input, const Shape& input_shape, DType activation_dtype,
                                    const nn::Pass& pass) {
  const int s = stage();
  const ChunkMap map{stages(), chunks(), chunk_placement(options_.schedule)};
  Tensor x;
  for (int g = 0; g < map.model_chunks(); ++g) {
    if (map.stage_of(g) != s) continue;
    nn::Module& chunk = *chunks_[size_t(map.local_of(g))];
    if (g == 0) {
      x = input;
    } else if (map.stage_of(g - 1) != s) {
      x = chunk.context().empty(input_shape, activation_dtype, chunk.spec().device);
      pipeline_.recv(x, map.stage_of(g - 1))->wait();
    }
    nn::Saved saved;
    x = chunk.forward(x, saved, pass);
    if (g + 1 == map.model_chunks()) return x;
    if (map.stage_of(g + 1) != s) pipeline_.send(x, map.stage_of(g + 1))->wait();
  }
  return Tensor();
}

int PipelineEngine::loss_stage() const {
  const ChunkMap map{stages(), chunks(), chunk_placement(options_.schedule)};
  return map.stage_of(map.model_chunks() - 1);
}

}  // namespace tessera::parallel
