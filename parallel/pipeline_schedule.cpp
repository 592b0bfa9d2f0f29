// The instruction lists of parallel/pipeline_schedule.h (GPipe, 1F1B,
// interleaved 1F1B, and the zero-bubble ZB-H1 and ZBV with generated
// exchanges), the rendezvous simulator that checks them (pairing, order,
// deadlock freedom, units in flight and awaiting their W, idle time) and the
// readable print of its timeline.
#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <iomanip>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>
#include <utility>

#include "core/error.h"

namespace tessera::parallel {

namespace {

struct ScheduleName {
  PipelineScheduleKind kind;
  std::string_view name;
};
constexpr ScheduleName kScheduleNames[] = {{PipelineScheduleKind::gpipe, "gpipe"},
                                           {PipelineScheduleKind::one_f_one_b, "1f1b"},
                                           {PipelineScheduleKind::zb_h1, "zb-h1"},
                                           {PipelineScheduleKind::zbv, "zbv"}};

}  // namespace

PipelineScheduleKind parse_pipeline_schedule(std::string_view text) {
  for (const ScheduleName& entry : kScheduleNames)
    if (text == entry.name) return entry.kind;
  TESSERA_THROW("--pipeline-schedule '", text, "' is not a schedule this build knows; use gpipe, 1f1b, zb-h1 or zbv");
}

std::string_view pipeline_schedule_name(PipelineScheduleKind kind) {
  for (const ScheduleName& entry : kScheduleNames)
    if (kind == entry.kind) return entry.name;
  return "unknown";
}

bool splits_backward(PipelineScheduleKind kind) {
  return kind == PipelineScheduleKind::zb_h1 || kind == PipelineScheduleKind::zbv;
}

ChunkPlacement chunk_placement(PipelineScheduleKind kind) {
  return kind == PipelineScheduleKind::zbv ? ChunkPlacement::v_shape : ChunkPlacement::loop;
}

// Under the V, odd local chunks run back down the stages: local 1 of stage s is model chunk 2P − 1 − s.
int ChunkMap::model_chunk(int stage, int local) const {
  if (placement == ChunkPlacement::loop || local % 2 == 0) return local * stages + stage;
  return (local + 1) * stages - 1 - stage;
}

int ChunkMap::stage_of(int model_chunk) const {
  const int offset = model_chunk % stages;
  return placement == ChunkPlacement::loop || local_of(model_chunk) % 2 == 0 ? offset : stages - 1 - offset;
}

int ChunkMap::local_of(int model_chunk) const {
  return model_chunk / stages;
}

std::string PipeInstruction::to_string() const {
  std::ostringstream out;
  const auto unit = [&out](int m, int c) {
    out << m;
    if (c != 0) out << "." << c;
  };
  if (computes()) {
    out << (op == Op::forward ? "F" : op == Op::backward ? "B" : "W");
    unit(micro, chunk);
  } else {
    out << "X[";
    for (size_t i = 0; i < transfers.size(); ++i) {
      const PipeTransfer& t = transfers[i];
      out << (i ? ", " : "") << (t.is_send() ? "send " : "recv ") << (t.is_activation() ? "act " : "grad ");
      unit(t.micro, t.chunk);
    }
    out << "]";
  }
  return out.str();
}

namespace {

using Kind = PipeTransfer::Kind;
using Op = PipeInstruction::Op;

// The model chunk at the other end of a transfer: the next one for an
// activation sent or a gradient received, the previous one otherwise; -1
// past either end of the model (the first chunk receives no activation and
// sends no gradient, the last sends no activation and receives no gradient).
int neighbour_chunk(const ChunkMap& map, int stage, const PipeTransfer& t) {
  const int neighbour = map.model_chunk(stage, t.chunk) + (t.to_next() ? 1 : -1);
  return neighbour >= 0 && neighbour < map.model_chunks() ? neighbour : -1;
}

// The model-chunk boundary a transfer crosses, the same seen from both ends:
// activations cross into the next chunk, gradients out of this one.
int crossed_boundary(const ChunkMap& map, int stage, const PipeTransfer& t) {
  const int model_chunk = map.model_chunk(stage, t.chunk);
  return t.to_next() ? model_chunk + 1 : model_chunk;
}

// Appends an exchange of the transfers that have a neighbour (see
// neighbour_chunk), each addressed to the stage that holds it.
void exchange(std::vector<PipeInstruction>& list, const ChunkMap& map, int stage, std::vector<PipeTransfer> transfers) {
  std::vector<PipeTransfer> kept;
  for (PipeTransfer& t : transfers) {
    const int neighbour = neighbour_chunk(map, stage, t);
    if (neighbour < 0) continue;
    t.peer = map.stage_of(neighbour);
    kept.push_back(t);
  }
  if (kept.empty()) return;
  PipeInstruction instruction;
  instruction.op = Op::exchange;
  instruction.transfers = std::move(kept);
  list.push_back(std::move(instruction));
}

void compute(std::vector<PipeInstruction>& list, Op op, int micro, int chunk = 0) {
  PipeInstruction instruction;
  instruction.op = op;
  instruction.micro = micro;
  instruction.chunk = chunk;
  list.push_back(instruction);
}

// Interleaved 1F1B (see the header), as Megatron-LM groups it: the warm-up
// forwards one by one, then steady groups of one forward and one backward,
// then the cool-down backwards one by one; after each group one exchange
// sends what the group produced and receives what the next group needs (the
// steady state's four transfers posted together, so neighbours never wait on
// each other's sends).
std::vector<PipeInstruction> interleaved_schedule(int stages, int stage, int micro_batches, int chunks) {
  const int p = stages, v = chunks, units = micro_batches * chunks;
  const ChunkMap map{stages, chunks};
  const auto micro_of = [p, v](int k) { return (k / (p * v)) * p + k % p; };
  const auto forward_chunk = [p, v](int k) { return (k % (p * v)) / p; };
  struct Unit {
    Op op;
    int micro, chunk;
  };
  const auto forward = [&](int k) { return Unit{Op::forward, micro_of(k), forward_chunk(k)}; };
  const auto backward = [&](int k) { return Unit{Op::backward, micro_of(k), v - 1 - forward_chunk(k)}; };
  std::vector<std::vector<Unit>> groups;
  const int warmup = std::min(2 * (p - stage - 1) + (v - 1) * p, units);
  for (int k = 0; k < warmup; ++k) groups.push_back({forward(k)});
  for (int k = 0; warmup + k < units; ++k) groups.push_back({forward(warmup + k), backward(k)});
  for (int k = units - warmup; k < units; ++k) groups.push_back({backward(k)});

  std::vector<PipeInstruction> list;
  for (size_t g = 0; g <= groups.size(); ++g) {
    std::vector<PipeTransfer> transfers;
    if (g > 0)
      for (const Unit& done : groups[g - 1])
        transfers.push_back(
            {done.op == Op::forward ? Kind::send_activation : Kind::send_gradient, done.micro, done.chunk});
    if (g < groups.size())
      for (const Unit& next : groups[g])
        transfers.push_back(
            {next.op == Op::forward ? Kind::recv_activation : Kind::recv_gradient, next.micro, next.chunk});
    exchange(list, map, stage, std::move(transfers));
    if (g < groups.size())
      for (const Unit& unit : groups[g]) compute(list, unit.op, unit.micro, unit.chunk);
  }
  return list;
}

std::vector<PipeInstruction> gpipe_schedule(int stages, int stage, int micro_batches) {
  const ChunkMap map{stages, 1};
  std::vector<PipeInstruction> list;
  for (int i = 0; i < micro_batches; ++i) {
    exchange(list, map, stage, {{Kind::recv_activation, i}});
    compute(list, Op::forward, i);
    exchange(list, map, stage, {{Kind::send_activation, i}});
  }
  for (int i = 0; i < micro_batches; ++i) {
    exchange(list, map, stage, {{Kind::recv_gradient, i}});
    compute(list, Op::backward, i);
    exchange(list, map, stage, {{Kind::send_gradient, i}});
  }
  return list;
}

std::vector<PipeInstruction> one_f_one_b_schedule(int stages, int stage, int micro_batches) {
  const ChunkMap map{stages, 1};
  const int s = stage, m = micro_batches;
  std::vector<PipeInstruction> list;
  const int warmup = std::min(stages - s - 1, m), remaining = m - warmup;
  for (int i = 0; i < warmup; ++i) {
    exchange(list, map, s, {{Kind::recv_activation, i}});
    compute(list, Op::forward, i);
    exchange(list, map, s, {{Kind::send_activation, i}});
  }
  if (remaining > 0) exchange(list, map, s, {{Kind::recv_activation, warmup}});
  for (int i = 0; i < remaining; ++i) {
    const int f = warmup + i;
    compute(list, Op::forward, f);
    exchange(list, map, s, {{Kind::send_activation, f}, {Kind::recv_gradient, i}});
    compute(list, Op::backward, i);
    if (i + 1 == remaining)
      exchange(list, map, s, {{Kind::send_gradient, i}});
    else
      exchange(list, map, s, {{Kind::send_gradient, i}, {Kind::recv_activation, f + 1}});
  }
  for (int i = remaining; i < m; ++i) {
    exchange(list, map, s, {{Kind::recv_gradient, i}});
    compute(list, Op::backward, i);
    exchange(list, map, s, {{Kind::send_gradient, i}});
  }
  return list;
}

// ---------------------------------------------------------------------------
// Zero-bubble schedules: compute orders, then generated exchanges
// ---------------------------------------------------------------------------

// One compute instruction of a stage's order: F, B or W of a micro-batch on a local chunk.
struct ComputeUnit {
  Op op;
  int micro, chunk;
};

// ZB-H1 on stage s: w = min(P − s − 1, M) warm-up forwards; then for each
// i < M − w: F(w + i), B(i), and the next pending W only once i ≥ s (stage s
// holds its W's back by s, so at most P micro-batches await their W); then
// each remaining B followed by the next pending W; then the W's left. W's run
// in micro-batch order.
std::vector<ComputeUnit> zb_h1_order(int stages, int stage, int micro_batches) {
  const int m = micro_batches, warmup = std::min(stages - stage - 1, m);
  std::vector<ComputeUnit> order;
  int next_weight = 0;
  const auto weight = [&order, &next_weight] { order.push_back({Op::weight, next_weight++, 0}); };
  for (int i = 0; i < warmup; ++i) order.push_back({Op::forward, i, 0});
  for (int i = 0; warmup + i < m; ++i) {
    order.push_back({Op::forward, warmup + i, 0});
    order.push_back({Op::backward, i, 0});
    if (i >= stage) weight();
  }
  for (int i = m - warmup; i < m; ++i) {
    order.push_back({Op::backward, i, 0});
    weight();
  }
  while (next_weight < m) weight();
  return order;
}

// ZBV on stage r (the handcrafted ZB-V of the paper's Section 6 as PyTorch's
// ScheduleZBVZeroBubble lays it out), laid out for n = max(2P − 1, M)
// micro-batches and cut to the M there are. Warm-up: 2(P − r) − 1 forwards of
// chunk 0; r pairs of forwards of chunk 1 and chunk 0; P − r groups of F, B, W
// of chunk 1. Steady, until every forward has run: F of chunk 0 (while any is
// left), B and W of chunk 0, F of chunk 1, B and W of chunk 1. Cool-down: r
// pairs of B of chunk 0 and chunk 1; P − r pairs of B and the oldest pending
// W of chunk 0; then the pending W's of chunk 1, then those of chunk 0. Each
// chunk's W's run in micro-batch order.
std::vector<ComputeUnit> zbv_order(int stages, int stage, int micro_batches) {
  const int p = stages, r = stage, n = std::max(2 * p - 1, micro_batches);
  std::vector<ComputeUnit> order;
  const auto add = [&order, micro_batches](Op op, int micro, int chunk) {
    if (micro < micro_batches) order.push_back({op, micro, chunk});
  };
  int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
  const auto backward_and_weight = [&add](int& counter, int chunk) {
    add(Op::backward, counter, chunk);
    add(Op::weight, counter++, chunk);
  };
  for (int i = 0; i < 2 * (p - r) - 1; ++i) add(Op::forward, f0++, 0);
  for (int i = 0; i < r; ++i) {
    add(Op::forward, f1++, 1);
    add(Op::forward, f0++, 0);
  }
  for (int i = 0; i < p - r; ++i) {
    add(Op::forward, f1++, 1);
    backward_and_weight(b1, 1);
  }
  while (f1 < f0 || f0 < n) {
    if (f0 < n) add(Op::forward, f0++, 0);
    backward_and_weight(b0, 0);
    add(Op::forward, f1++, 1);
    backward_and_weight(b1, 1);
  }
  int w0 = b0, w1 = b1;
  for (int i = 0; i < r; ++i) {
    add(Op::backward, b0++, 0);
    add(Op::backward, b1++, 1);
  }
  for (int i = 0; i < p - r; ++i) {
    add(Op::backward, b0++, 0);
    add(Op::weight, w0++, 0);
  }
  while (w1 < b1) add(Op::weight, w1++, 1);
  while (w0 < b0) add(Op::weight, w0++, 0);
  return order;
}

// The finish time of every stage's compute instructions, each run as soon as
// its stage and its dependencies allow, every op taking one time unit: F of
// model chunk g needs F of g − 1 of the same micro-batch, B of g needs F of g
// and B of g + 1 (the last chunk's B only its F), W needs its B.
std::vector<std::vector<int>> unit_cost_finish_times(const std::vector<std::vector<ComputeUnit>>& orders,
                                                     const ChunkMap& map, int micro_batches) {
  const int chunks = map.model_chunks();
  std::vector<int> finished(size_t(3) * size_t(chunks) * size_t(micro_batches), 0);  // 0: not run yet
  const auto at = [&finished, chunks, micro_batches](Op op, int model_chunk, int micro) -> int& {
    const size_t kind = op == Op::forward ? 0 : op == Op::backward ? 1 : 2;
    return finished[(kind * size_t(chunks) + size_t(model_chunk)) * size_t(micro_batches) + size_t(micro)];
  };
  // When the unit's inputs are ready; -1 while one is missing.
  const auto ready = [&](const ComputeUnit& u, int g) {
    std::vector<int> needs;
    if (u.op == Op::forward && g > 0) needs.push_back(at(Op::forward, g - 1, u.micro));
    if (u.op == Op::backward) needs.push_back(at(Op::forward, g, u.micro));
    if (u.op == Op::backward && g + 1 < chunks) needs.push_back(at(Op::backward, g + 1, u.micro));
    if (u.op == Op::weight) needs.push_back(at(Op::backward, g, u.micro));
    int time = 0;
    for (const int finish : needs) {
      if (finish == 0) return -1;
      time = std::max(time, finish);
    }
    return time;
  };
  const size_t stages = orders.size();
  std::vector<std::vector<int>> finish(stages);
  std::vector<int> clock(stages, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t s = 0; s < stages; ++s)
      for (size_t k = finish[s].size(); k < orders[s].size(); ++k) {
        const ComputeUnit& u = orders[s][k];
        const int g = map.model_chunk(int(s), u.chunk), start = ready(u, g);
        if (start < 0) break;
        clock[s] = std::max(clock[s], start) + 1;
        at(u.op, g, u.micro) = clock[s];
        finish[s].push_back(clock[s]);
        progress = true;
      }
  }
  for (size_t s = 0; s < stages; ++s)
    TESSERA_CHECK(finish[s].size() == orders[s].size(), "pipeline schedule: stage ", s,
                  "'s compute order waits forever at instruction ", finish[s].size(),
                  "; a bug in the schedule generator (parallel/pipeline_schedule.cpp)");
  return finish;
}

// The transfer a compute unit's result needs, as (the producer's send, the
// consumer's receive): an activation after a forward, a gradient after a
// backward (B), to the stage of the neighbouring model chunk; none past the
// model's ends or between two chunks of one stage (handed over locally).
std::optional<std::pair<PipeTransfer, PipeTransfer>> transfer_after(const ChunkMap& map, int stage,
                                                                    const ComputeUnit& u) {
  if (u.op == Op::weight) return std::nullopt;
  const bool activation = u.op == Op::forward;
  PipeTransfer send{activation ? Kind::send_activation : Kind::send_gradient, u.micro, u.chunk};
  const int neighbour = neighbour_chunk(map, stage, send);
  if (neighbour < 0 || map.stage_of(neighbour) == stage) return std::nullopt;
  send.peer = map.stage_of(neighbour);
  const PipeTransfer receive{activation ? Kind::recv_activation : Kind::recv_gradient, u.micro, map.local_of(neighbour),
                             stage};
  return std::make_pair(send, receive);
}

// Stage `stage`'s list: its compute order with one exchange per time at which
// it has transfers (see the header). A stage finishes one op at a time, so an
// exchange carries at most one message each way between two stages, and
// messages pair whatever the order within it; it is sorted (activations
// first, then by micro-batch and boundary, the same keys at both ends) for a
// list that reads the same on every run.
std::vector<PipeInstruction> with_generated_exchanges(const std::vector<std::vector<ComputeUnit>>& orders,
                                                      const ChunkMap& map, int stage, int micro_batches) {
  const std::vector<std::vector<int>> finish = unit_cost_finish_times(orders, map, micro_batches);
  std::map<int, std::vector<PipeTransfer>> by_time;
  for (size_t s = 0; s < orders.size(); ++s)
    for (size_t k = 0; k < orders[s].size(); ++k) {
      const auto transfer = transfer_after(map, int(s), orders[s][k]);
      if (!transfer) continue;
      if (int(s) == stage) by_time[finish[s][k]].push_back(transfer->first);
      if (transfer->first.peer == stage) by_time[finish[s][k]].push_back(transfer->second);
    }
  const auto key = [&map, stage](const PipeTransfer& t) {
    return std::make_tuple(!t.is_activation(), t.micro, crossed_boundary(map, stage, t));
  };
  std::vector<PipeInstruction> list;
  auto next = by_time.begin();
  const auto exchanges_until = [&](int time) {
    for (; next != by_time.end() && next->first <= time; ++next) {
      std::sort(next->second.begin(), next->second.end(),
                [&key](const PipeTransfer& a, const PipeTransfer& b) { return key(a) < key(b); });
      exchange(list, map, stage, next->second);
    }
  };
  const std::vector<ComputeUnit>& order = orders[size_t(stage)];
  for (size_t k = 0; k < order.size(); ++k) {
    exchanges_until(finish[size_t(stage)][k] - 1);  // every op takes one unit: it starts one before it finishes
    compute(list, order[k].op, order[k].micro, order[k].chunk);
  }
  exchanges_until(std::numeric_limits<int>::max());
  return list;
}

std::vector<PipeInstruction> zero_bubble_schedule(PipelineScheduleKind kind, int stages, int stage, int micro_batches) {
  const ChunkMap map{stages, kind == PipelineScheduleKind::zbv ? 2 : 1, chunk_placement(kind)};
  std::vector<std::vector<ComputeUnit>> orders;
  for (int s = 0; s < stages; ++s)
    orders.push_back(kind == PipelineScheduleKind::zbv ? zbv_order(stages, s, micro_batches)
                                                       : zb_h1_order(stages, s, micro_batches));
  return with_generated_exchanges(orders, map, stage, micro_batches);
}

// The number of chunks per stage each schedule runs with: zb-h1 one, zbv
// two; gpipe one, 1f1b any (more than one interleaves it).
void check_chunks(PipelineScheduleKind kind, int stages, int micro_batches, int chunks) {
  if (kind == PipelineScheduleKind::zb_h1)
    TESSERA_CHECK(chunks == 1, "--pipeline-schedule zb-h1 runs one model chunk per stage, not ",
                  "--virtual-pipeline-stages ", chunks,
                  "; use --virtual-pipeline-stages 1, or --pipeline-schedule zbv for two chunks per stage in a V");
  if (kind == PipelineScheduleKind::zbv)
    TESSERA_CHECK(chunks == 2, "--pipeline-schedule zbv runs two model chunks per stage in a V, not ",
                  "--virtual-pipeline-stages ", chunks, "; use --virtual-pipeline-stages 2");
  if (kind == PipelineScheduleKind::zb_h1 || kind == PipelineScheduleKind::zbv || chunks == 1) return;
  TESSERA_CHECK(kind == PipelineScheduleKind::one_f_one_b, "--virtual-pipeline-stages ", chunks,
                " interleaves the 1F1B schedule; use --pipeline-schedule 1f1b (or zbv with 2 chunks, or "
                "--virtual-pipeline-stages 1)");
  TESSERA_CHECK(micro_batches % stages == 0, "--virtual-pipeline-stages ", chunks, ": the ", micro_batches,
                " micro-batches of a step must be a multiple of the ", stages,
                " pipeline stages (micro-batches per step = --global-batch-size / (--micro-batch-size x data-parallel "
                "ranks)); change --global-batch-size, or use --virtual-pipeline-stages 1");
}

}  // namespace

std::vector<PipeInstruction> pipeline_schedule(PipelineScheduleKind kind, int stages, int stage, int micro_batches,
                                               int chunks) {
  TESSERA_CHECK(stages >= 1 && stage >= 0 && stage < stages && micro_batches >= 1 && chunks >= 1,
                "pipeline schedule: stage ", stage, " of ", stages, " with ", micro_batches, " micro-batch(es) and ",
                chunks, " chunk(s) per stage does not exist");
  check_chunks(kind, stages, micro_batches, chunks);
  if (splits_backward(kind)) return zero_bubble_schedule(kind, stages, stage, micro_batches);
  if (chunks > 1) return interleaved_schedule(stages, stage, micro_batches, chunks);
  if (kind == PipelineScheduleKind::gpipe) return gpipe_schedule(stages, stage, micro_batches);
  return one_f_one_b_schedule(stages, stage, micro_batches);
}

// ---------------------------------------------------------------------------
// Simulation
// ---------------------------------------------------------------------------
namespace {

// The messages from one stage to another, in posting order: the k-th send
// pairs with the k-th receive, whatever they carry (untagged messages).
struct Channel {
  struct Posted {
    int stage, micro;
    double time;
    bool activation;
    int boundary;  // the model-chunk boundary crossed (crossed_boundary)
  };
  std::vector<Posted> sends, receives;
};

// A stage's progress through its list.
struct StageState {
  size_t pc = 0;
  double clock = 0, work = 0;
  bool posted = false;                            // the current exchange's transfers are posted
  std::vector<std::pair<Channel*, size_t>> mine;  // (channel, index in its sends/receives) of the current exchange
  std::vector<bool> mine_is_send;
  // Per unit (chunk · M + micro).
  std::vector<bool> forwarded, backwarded, weighted, has_weight, activation_in, gradient_in;
  bool splits = false;  // the list has a W
  int in_flight = 0, awaiting_weight = 0, max_in_flight = 0, max_awaiting_weight = 0;
  std::vector<PipelineSimulation::TimedOp> timeline;
};

int chunk_count(const std::vector<std::vector<PipeInstruction>>& lists) {
  int chunks = 1;
  for (const auto& list : lists)
    for (const PipeInstruction& in : list) {
      chunks = std::max(chunks, in.chunk + 1);
      for (const PipeTransfer& t : in.transfers) chunks = std::max(chunks, t.chunk + 1);
    }
  return chunks;
}

std::string describe_unit(int micro, int chunk) {
  return "micro-batch " + std::to_string(micro) + (chunk ? " chunk " + std::to_string(chunk) : "");
}

std::string unit_label(Op op, int micro, int chunk) {
  PipeInstruction instruction;
  instruction.op = op;
  instruction.micro = micro;
  instruction.chunk = chunk;
  return instruction.to_string();
}

// Sizes a stage's per-unit state and marks the units its list has a W for.
void start_stage(StageState& st, const std::vector<PipeInstruction>& list, int micro_batches, int chunks) {
  const size_t units = size_t(chunks) * size_t(micro_batches);
  for (auto* flags : {&st.forwarded, &st.backwarded, &st.weighted, &st.has_weight, &st.activation_in, &st.gradient_in})
    flags->assign(units, false);
  for (const PipeInstruction& in : list)
    if (in.op == Op::weight && in.micro >= 0 && in.micro < micro_batches && in.chunk >= 0) {
      st.has_weight[size_t(in.chunk) * size_t(micro_batches) + size_t(in.micro)] = true;
      st.splits = true;
    }
}

// Runs one F, B or W on a stage: empty, or why it may not run now.
// A forward needs its input (received, or handed over by the stage's own
// forward of the previous model chunk), a backward its forward and its
// gradient (likewise), a W its B. A whole backward (no W for its unit)
// takes 2 time units, everything else 1.
std::string run_compute(const ChunkMap& map, const PipelineCosts& costs, int stage, int micro_batches,
                        const PipeInstruction& in, StageState& st) {
  const int g = map.model_chunk(stage, in.chunk);
  const auto unit = [micro_batches](int micro, int chunk) {
    return size_t(chunk) * size_t(micro_batches) + size_t(micro);
  };
  const size_t u = unit(in.micro, in.chunk);
  bool split = true;
  if (in.op == Op::forward) {
    if (st.forwarded[u]) return " runs twice";
    if (g > 0 && map.stage_of(g - 1) == stage && !st.forwarded[unit(in.micro, map.local_of(g - 1))])
      return " runs before " + unit_label(Op::forward, in.micro, map.local_of(g - 1)) +
             ", which hands it its input on this stage";
    if (g > 0 && map.stage_of(g - 1) != stage && !st.activation_in[u]) return " runs before its activation arrived";
    st.forwarded[u] = true;
    st.max_in_flight = std::max(st.max_in_flight, ++st.in_flight);
    st.max_awaiting_weight = std::max(st.max_awaiting_weight, ++st.awaiting_weight);
  } else if (in.op == Op::backward) {
    if (!st.forwarded[u]) return " runs before its forward";
    if (st.backwarded[u]) return " runs twice";
    const bool has_next = g + 1 < map.model_chunks();
    if (has_next && map.stage_of(g + 1) == stage && !st.backwarded[unit(in.micro, map.local_of(g + 1))])
      return " runs before " + unit_label(Op::backward, in.micro, map.local_of(g + 1)) +
             ", which hands it its gradient on this stage";
    if (has_next && map.stage_of(g + 1) != stage && !st.gradient_in[u]) return " runs before its gradient arrived";
    st.backwarded[u] = true;
    --st.in_flight;
    if (!st.has_weight[u]) {
      --st.awaiting_weight;
      split = false;
    }
  } else {
    if (!st.backwarded[u]) return " runs before its backward (" + unit_label(Op::backward, in.micro, in.chunk) + ")";
    if (st.weighted[u]) return " runs twice";
    st.weighted[u] = true;
    --st.awaiting_weight;
  }
  const double cost = costs.of(in.op, g, split);
  st.timeline.push_back({in.op, in.micro, in.chunk, st.clock, st.clock + cost});
  st.clock += cost;
  st.work += cost;
  return {};
}

// Posts an exchange's transfers on their channels: empty, or why one of them is wrong.
std::string post_exchange(const ChunkMap& map, int stage, int micro_batches, const PipeInstruction& in, StageState& st,
                          std::map<std::pair<int, int>, Channel>& channels) {
  st.mine.clear();
  st.mine_is_send.clear();
  for (const PipeTransfer& t : in.transfers) {
    const bool named = t.chunk >= 0 && t.micro >= 0 && t.micro < micro_batches;
    const int neighbour = named ? neighbour_chunk(map, stage, t) : -1;
    if (neighbour < 0) return " talks to a stage that does not exist";
    const int holder = map.stage_of(neighbour);
    if (holder == stage)
      return " sends model chunk " + std::to_string(neighbour) +
             "'s tensor to its own stage, where it is handed over locally, not exchanged";
    if (t.peer != holder)
      return " addresses stage " + std::to_string(t.peer) + ", but model chunk " + std::to_string(neighbour) +
             " is on stage " + std::to_string(holder);
    const size_t u = size_t(t.chunk) * size_t(micro_batches) + size_t(t.micro);
    if (t.is_send() && !(t.is_activation() ? st.forwarded[u] : st.backwarded[u]))
      return " sends what it has not computed yet";
    Channel& channel = channels[t.is_send() ? std::make_pair(stage, t.peer) : std::make_pair(t.peer, stage)];
    auto& side = t.is_send() ? channel.sends : channel.receives;
    side.push_back({stage, t.micro, st.clock, t.is_activation(), crossed_boundary(map, stage, t)});
    st.mine.emplace_back(&channel, side.size() - 1);
    st.mine_is_send.push_back(t.is_send());
  }
  st.posted = true;
  return {};
}

// Whether every transfer of the posted exchange has its counterpart (then
// the stage's clock moves to the latest of them), in `complete`; empty, or
// why a counterpart does not match.
std::string try_complete_exchange(const PipeInstruction& in, int micro_batches, double transfer, StageState& st,
                                  bool& complete) {
  double done_at = st.clock;
  complete = false;
  for (size_t k = 0; k < st.mine.size(); ++k) {
    Channel& channel = *st.mine[k].first;
    const size_t index = st.mine[k].second;
    auto& other = st.mine_is_send[k] ? channel.receives : channel.sends;
    if (other.size() <= index) return {};
    const auto& mine = st.mine_is_send[k] ? channel.sends[index] : channel.receives[index];
    const auto& theirs = other[index];
    if (theirs.micro != mine.micro || theirs.activation != mine.activation || theirs.boundary != mine.boundary)
      return " pairs with micro-batch " + std::to_string(theirs.micro) + " (" +
             (theirs.activation ? "activation" : "gradient") + " at chunk boundary " + std::to_string(theirs.boundary) +
             ") on stage " + std::to_string(theirs.stage);
    done_at = std::max(done_at, std::max(mine.time, theirs.time) + transfer);
  }
  for (const PipeTransfer& t : in.transfers) {
    const size_t u = size_t(t.chunk) * size_t(micro_batches) + size_t(t.micro);
    if (t.kind == Kind::recv_activation) st.activation_in[u] = true;
    if (t.kind == Kind::recv_gradient) st.gradient_in[u] = true;
  }
  st.clock = done_at;
  st.posted = false;
  complete = true;
  return {};
}

// After the run: every unit forwarded and backwarded, and given its W when the list has any.
std::string check_every_unit_ran(const StageState& st, int micro_batches, int chunks) {
  for (int c = 0; c < chunks; ++c)
    for (int mb = 0; mb < micro_batches; ++mb) {
      const size_t u = size_t(c) * size_t(micro_batches) + size_t(mb);
      if (!st.forwarded[u] || !st.backwarded[u]) return describe_unit(mb, c) + " is not run forward and backward";
      if (st.splits && !st.weighted[u])
        return describe_unit(mb, c) + " has no W (weight gradient) though the stage's list splits its other backwards";
    }
  return {};
}

std::string describe_deadlock(const std::vector<std::vector<PipeInstruction>>& lists,
                              const std::vector<StageState>& state) {
  std::ostringstream why;
  why << "deadlock:";
  for (size_t t = 0; t < lists.size(); ++t)
    if (state[t].pc < lists[t].size())
      why << " stage " << t << " waits in " << lists[t][state[t].pc].to_string() << ";";
  return why.str();
}

}  // namespace

double PipelineCosts::of(PipeInstruction::Op op, int model_chunk, bool split) const {
  const auto pick = [model_chunk](const std::vector<double>& costs, double unit) {
    return costs.empty() ? unit : costs.at(size_t(model_chunk));
  };
  switch (op) {
    case Op::forward:
      return pick(forward, 1);
    case Op::backward:
      return split ? pick(input_gradient, 1) : pick(backward, 2);
    case Op::weight:
      return pick(weight_gradient, 1);
    default:
      return 0;
  }
}

double PipelineSimulation::span() const {
  return finish_time.empty() ? 0.0 : *std::max_element(finish_time.begin(), finish_time.end());
}

PipelineSimulation simulate_pipeline(const std::vector<std::vector<PipeInstruction>>& lists, int micro_batches,
                                     ChunkPlacement placement, const PipelineCosts& costs) {
  const int p = int(lists.size()), v = chunk_count(lists);
  const ChunkMap map{p, v, placement};
  PipelineSimulation result;
  std::map<std::pair<int, int>, Channel> channels;  // (sender, receiver)
  std::vector<StageState> state(static_cast<size_t>(p));
  for (int s = 0; s < p; ++s) start_stage(state[size_t(s)], lists[size_t(s)], micro_batches, v);
  const auto fail = [&](int stage, const std::string& why) {
    result.problem = "stage " + std::to_string(stage) + ": " + why;
    return result;
  };

  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      StageState& st = state[size_t(s)];
      while (st.pc < lists[size_t(s)].size()) {
        const PipeInstruction& in = lists[size_t(s)][st.pc];
        std::string problem;
        bool done = true;
        if (in.computes() && (in.micro < 0 || in.micro >= micro_batches || in.chunk < 0))
          problem = " names no micro-batch or chunk";
        else if (in.computes())
          problem = run_compute(map, costs, s, micro_batches, in, st);
        else {
          if (!st.posted) problem = post_exchange(map, s, micro_batches, in, st, channels);
          if (problem.empty()) problem = try_complete_exchange(in, micro_batches, costs.transfer, st, done);
        }
        if (!problem.empty()) return fail(s, in.to_string() + problem);
        if (!done) break;
        ++st.pc;
        progress = true;
      }
    }
  }
  for (int s = 0; s < p; ++s)
    if (state[size_t(s)].pc < lists[size_t(s)].size()) {
      result.problem = describe_deadlock(lists, state);
      return result;
    }
  for (int s = 0; s < p; ++s) {
    const std::string missing = check_every_unit_ran(state[size_t(s)], micro_batches, v);
    if (!missing.empty()) return fail(s, missing);
  }
  for (const auto& [key, channel] : channels)
    if (channel.sends.size() != channel.receives.size())
      return fail(key.first, std::to_string(channel.sends.size()) + " sends but " +
                                 std::to_string(channel.receives.size()) + " receives to stage " +
                                 std::to_string(key.second));
  // Idle: the step's span (the last stage to finish) minus the stage's own work.
  double span = 0;
  for (const StageState& st : state) span = std::max(span, st.clock);
  for (StageState& st : state) {
    result.max_in_flight.push_back(st.max_in_flight);
    result.max_awaiting_weight.push_back(st.max_awaiting_weight);
    result.finish_time.push_back(st.clock);
    result.idle_time.push_back(span - st.work);
    result.timeline.push_back(std::move(st.timeline));
  }
  result.completed = true;
  return result;
}

std::string describe_schedule(const std::vector<std::vector<PipeInstruction>>& lists, int micro_batches,
                              ChunkPlacement placement) {
  const PipelineSimulation sim = simulate_pipeline(lists, micro_batches, placement);
  TESSERA_CHECK(sim.completed, "pipeline schedule: the stages' lists do not complete: ", sim.problem);
  const size_t p = lists.size();
  const int span = int(sim.span());  // unit costs: whole numbers
  std::vector<std::vector<std::string>> cells(p, std::vector<std::string>(size_t(span), "."));
  size_t width = 1;
  for (size_t s = 0; s < p; ++s)
    for (const PipelineSimulation::TimedOp& op : sim.timeline[s]) {
      const std::string label = unit_label(op.op, op.micro, op.chunk);
      width = std::max(width, label.size());
      for (int t = int(op.start); t < int(op.end); ++t) cells[s][size_t(t)] = label;
    }
  const size_t name_width = ("stage " + std::to_string(p - 1) + ":").size();
  std::ostringstream out;
  for (size_t s = 0; s < p; ++s) {
    std::ostringstream row;
    row << std::left << std::setw(int(name_width)) << "stage " + std::to_string(s) + ":";
    for (const std::string& cell : cells[s]) row << ' ' << std::setw(int(width)) << cell;
    std::string text = row.str();
    text.erase(text.find_last_not_of(' ') + 1);
    out << text << '\n';
  }
  double idle = 0;
  for (const double stage_idle : sim.idle_time) idle += stage_idle;
  out << "bubble " << std::fixed << std::setprecision(1) << 100.0 * idle / (double(span) * double(p))
      << "% of a span of " << span << " time units (F, B and W 1 each, a whole backward 2); peak units in flight per "
      << "stage";
  for (const int peak : sim.max_in_flight) out << ' ' << peak;
  out << "; awaiting their W";
  for (const int peak : sim.max_awaiting_weight) out << ' ' << peak;
  out << '\n';
  return out.str();
}

}  // namespace tessera::parallel
