// The GPipe and 1F1B instruction lists of parallel/pipeline_schedule.h and
// the rendezvous simulator that checks them (pairing, order, deadlock
// freedom, micro-batches in flight, idle time).
#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <deque>
#include <map>
#include <sstream>

#include "core/error.h"

namespace tessera::parallel {

PipelineScheduleKind parse_pipeline_schedule(std::string_view text) {
  if (text == "gpipe") return PipelineScheduleKind::gpipe;
  if (text == "1f1b") return PipelineScheduleKind::one_f_one_b;
  TESSERA_THROW("--pipeline-schedule '", text, "' is not a schedule this build knows; use gpipe or 1f1b");
}

std::string_view pipeline_schedule_name(PipelineScheduleKind kind) {
  return kind == PipelineScheduleKind::gpipe ? "gpipe" : "1f1b";
}

std::string PipeInstruction::to_string() const {
  std::ostringstream out;
  const auto unit = [&out](int m, int c) {
    out << m;
    if (c != 0) out << "." << c;
  };
  if (op == Op::forward || op == Op::backward) {
    out << (op == Op::forward ? "F" : "B");
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

// Whether the chunk a transfer concerns has a neighbour on its side: the
// model's first chunk receives no activation and sends no gradient, the last
// sends no activation and receives no gradient.
bool has_neighbour(const PipeTransfer& t, int stage, int stages, int chunks) {
  const int model_chunk = t.chunk * stages + stage;
  return t.to_next() ? model_chunk + 1 < stages * chunks : model_chunk > 0;
}

// Appends an exchange of the transfers that apply (see has_neighbour).
void exchange(std::vector<PipeInstruction>& list, int stage, int stages, std::vector<PipeTransfer> transfers,
              int chunks = 1) {
  std::vector<PipeTransfer> kept;
  for (const PipeTransfer& t : transfers)
    if (has_neighbour(t, stage, stages, chunks)) kept.push_back(t);
  if (kept.empty()) return;
  PipeInstruction instruction;
  instruction.op = PipeInstruction::Op::exchange;
  instruction.transfers = std::move(kept);
  list.push_back(std::move(instruction));
}

void compute(std::vector<PipeInstruction>& list, PipeInstruction::Op op, int micro, int chunk = 0) {
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
  using Op = PipeInstruction::Op;
  const int p = stages, v = chunks, units = micro_batches * chunks;
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
    exchange(list, stage, stages, std::move(transfers), chunks);
    if (g < groups.size())
      for (const Unit& unit : groups[g]) compute(list, unit.op, unit.micro, unit.chunk);
  }
  return list;
}

}  // namespace

std::vector<PipeInstruction> pipeline_schedule(PipelineScheduleKind kind, int stages, int stage, int micro_batches,
                                               int chunks) {
  TESSERA_CHECK(stages >= 1 && stage >= 0 && stage < stages && micro_batches >= 1 && chunks >= 1,
                "pipeline schedule: stage ", stage, " of ", stages, " with ", micro_batches, " micro-batch(es) and ",
                chunks, " chunk(s) per stage does not exist");
  if (chunks > 1) {
    TESSERA_CHECK(kind == PipelineScheduleKind::one_f_one_b, "--virtual-pipeline-stages ", chunks,
                  " interleaves the 1F1B schedule; use --pipeline-schedule 1f1b (or --virtual-pipeline-stages 1)");
    TESSERA_CHECK(
        micro_batches % stages == 0, "--virtual-pipeline-stages ", chunks, ": the ", micro_batches,
        " micro-batches of a step must be a multiple of the ", stages,
        " pipeline stages (micro-batches per step = --global-batch-size / (--micro-batch-size x data-parallel "
        "ranks)); change --global-batch-size, or use --virtual-pipeline-stages 1");
    return interleaved_schedule(stages, stage, micro_batches, chunks);
  }
  using Op = PipeInstruction::Op;
  std::vector<PipeInstruction> list;
  const int s = stage, p = stages, m = micro_batches;
  if (kind == PipelineScheduleKind::gpipe) {
    for (int i = 0; i < m; ++i) {
      exchange(list, s, p, {{Kind::recv_activation, i}});
      compute(list, Op::forward, i);
      exchange(list, s, p, {{Kind::send_activation, i}});
    }
    for (int i = 0; i < m; ++i) {
      exchange(list, s, p, {{Kind::recv_gradient, i}});
      compute(list, Op::backward, i);
      exchange(list, s, p, {{Kind::send_gradient, i}});
    }
    return list;
  }
  const int warmup = std::min(p - s - 1, m), remaining = m - warmup;
  for (int i = 0; i < warmup; ++i) {
    exchange(list, s, p, {{Kind::recv_activation, i}});
    compute(list, Op::forward, i);
    exchange(list, s, p, {{Kind::send_activation, i}});
  }
  if (remaining > 0) exchange(list, s, p, {{Kind::recv_activation, warmup}});
  for (int i = 0; i < remaining; ++i) {
    const int f = warmup + i;
    compute(list, Op::forward, f);
    exchange(list, s, p, {{Kind::send_activation, f}, {Kind::recv_gradient, i}});
    compute(list, Op::backward, i);
    if (i + 1 == remaining)
      exchange(list, s, p, {{Kind::send_gradient, i}});
    else
      exchange(list, s, p, {{Kind::send_gradient, i}, {Kind::recv_activation, f + 1}});
  }
  for (int i = remaining; i < m; ++i) {
    exchange(list, s, p, {{Kind::recv_gradient, i}});
    compute(list, Op::backward, i);
    exchange(list, s, p, {{Kind::send_gradient, i}});
  }
  return list;
}

// ---------------------------------------------------------------------------
// Simulation
// ---------------------------------------------------------------------------
namespace {

// The messages from one stage to another, in posting order: the k-th send
// pairs with the k-th receive, whatever they carry (untagged messages).
struct Channel {
  struct Posted {
    int stage, micro, time;
    bool activation;
    int boundary;  // the model-chunk boundary crossed: activations into chunk b, gradients out of chunk b
  };
  std::vector<Posted> sends, receives;
};

// A stage's progress through its list.
struct StageState {
  size_t pc = 0;
  int clock = 0;
  bool posted = false;                            // the current exchange's transfers are posted
  std::vector<std::pair<Channel*, size_t>> mine;  // (channel, index in its sends/receives) of the current exchange
  std::vector<bool> mine_is_send;
  std::vector<bool> forwarded, backwarded, activation_in, gradient_in;  // per unit: chunk · M + micro
  int in_flight = 0;
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

}  // namespace

// Over 120 lines on purpose: one rendezvous state machine whose checks (pairing,
// ordering, exactly-once receipt) share its state at each event; split, each
// part would take the whole state as arguments.
PipelineSimulation simulate_pipeline(const std::vector<std::vector<PipeInstruction>>& lists, int micro_batches) {
  const int p = int(lists.size()), v = chunk_count(lists), total_chunks = p * v;
  constexpr int kForwardTime = 1, kBackwardTime = 2;
  PipelineSimulation result;
  result.max_in_flight.assign(size_t(p), 0);
  result.finish_time.assign(size_t(p), 0);
  result.idle_time.assign(size_t(p), 0);
  std::map<std::pair<int, int>, Channel> channels;  // (sender, receiver)
  std::vector<StageState> state(static_cast<size_t>(p));
  const size_t units = size_t(v) * size_t(micro_batches);
  for (auto& st : state) {
    st.forwarded.assign(units, false);
    st.backwarded.assign(units, false);
    st.activation_in.assign(units, false);
    st.gradient_in.assign(units, false);
  }
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
        if (in.op != PipeInstruction::Op::exchange) {
          const int mb = in.micro, model_chunk = in.chunk * p + s;
          if (mb < 0 || mb >= micro_batches || in.chunk < 0)
            return fail(s, in.to_string() + " names no micro-batch or chunk");
          const size_t u = size_t(in.chunk) * size_t(micro_batches) + size_t(mb);
          if (in.op == PipeInstruction::Op::forward) {
            if (st.forwarded[u]) return fail(s, in.to_string() + " runs twice");
            if (model_chunk > 0 && !st.activation_in[u])
              return fail(s, in.to_string() + " runs before its activation arrived");
            st.forwarded[u] = true;
            result.max_in_flight[size_t(s)] = std::max(result.max_in_flight[size_t(s)], ++st.in_flight);
            st.clock += kForwardTime;
          } else {
            if (!st.forwarded[u]) return fail(s, in.to_string() + " runs before its forward");
            if (st.backwarded[u]) return fail(s, in.to_string() + " runs twice");
            if (model_chunk + 1 < total_chunks && !st.gradient_in[u])
              return fail(s, in.to_string() + " runs before its gradient arrived");
            st.backwarded[u] = true;
            --st.in_flight;
            st.clock += kBackwardTime;
          }
          ++st.pc;
          progress = true;
          continue;
        }
        if (!st.posted) {
          st.mine.clear();
          st.mine_is_send.clear();
          for (const PipeTransfer& t : in.transfers) {
            const int model_chunk = t.chunk * p + s;
            const bool exists = t.to_next() ? model_chunk + 1 < total_chunks : model_chunk > 0;
            if (!exists || t.chunk < 0 || t.micro < 0 || t.micro >= micro_batches)
              return fail(s, in.to_string() + " talks to a stage that does not exist");
            const int peer = t.peer(s, p);
            // Activations cross into the next chunk, gradients out of this rank's chunk into the previous one.
            const int boundary = t.to_next() ? model_chunk + 1 : model_chunk;
            Channel& channel = channels[t.is_send() ? std::make_pair(s, peer) : std::make_pair(peer, s)];
            auto& side = t.is_send() ? channel.sends : channel.receives;
            side.push_back({s, t.micro, st.clock, t.is_activation(), boundary});
            st.mine.emplace_back(&channel, side.size() - 1);
            st.mine_is_send.push_back(t.is_send());
            if (t.is_send()) {
              const size_t u = size_t(t.chunk) * size_t(micro_batches) + size_t(t.micro);
              const bool have = t.is_activation() ? st.forwarded[u] : st.backwarded[u];
              if (!have) return fail(s, in.to_string() + " sends what it has not computed yet");
            }
          }
          st.posted = true;
          progress = true;
        }
        // Complete when every transfer has its counterpart posted.
        int done_at = st.clock;
        bool complete = true;
        for (size_t k = 0; k < st.mine.size(); ++k) {
          Channel& channel = *st.mine[k].first;
          const size_t index = st.mine[k].second;
          auto& other = st.mine_is_send[k] ? channel.receives : channel.sends;
          if (other.size() <= index) {
            complete = false;
            break;
          }
          const auto& mine = st.mine_is_send[k] ? channel.sends[index] : channel.receives[index];
          const auto& theirs = other[index];
          if (theirs.micro != mine.micro || theirs.activation != mine.activation || theirs.boundary != mine.boundary)
            return fail(s, in.to_string() + " pairs with micro-batch " + std::to_string(theirs.micro) + " (" +
                               (theirs.activation ? "activation" : "gradient") + " at chunk boundary " +
                               std::to_string(theirs.boundary) + ") on stage " + std::to_string(theirs.stage));
          done_at = std::max(done_at, theirs.time);
        }
        if (!complete) break;
        for (const PipeTransfer& t : in.transfers) {
          const size_t u = size_t(t.chunk) * size_t(micro_batches) + size_t(t.micro);
          if (t.kind == Kind::recv_activation) st.activation_in[u] = true;
          if (t.kind == Kind::recv_gradient) st.gradient_in[u] = true;
        }
        st.clock = done_at;
        st.posted = false;
        ++st.pc;
        progress = true;
      }
    }
  }
  for (int s = 0; s < p; ++s) {
    const StageState& st = state[size_t(s)];
    if (st.pc < lists[size_t(s)].size()) {
      std::ostringstream why;
      why << "deadlock:";
      for (int t = 0; t < p; ++t)
        if (state[size_t(t)].pc < lists[size_t(t)].size())
          why << " stage " << t << " waits in " << lists[size_t(t)][state[size_t(t)].pc].to_string() << ";";
      result.problem = why.str();
      return result;
    }
    for (int c = 0; c < v; ++c)
      for (int mb = 0; mb < micro_batches; ++mb) {
        const size_t u = size_t(c) * size_t(micro_batches) + size_t(mb);
        if (!st.forwarded[u] || !st.backwarded[u])
          return fail(s, describe_unit(mb, c) + " is not run forward and backward");
      }
    result.finish_time[size_t(s)] = st.clock;
  }
  // Idle: the step's span (the last stage to finish) minus the stage's own work.
  const int span = *std::max_element(result.finish_time.begin(), result.finish_time.end());
  for (int s = 0; s < p; ++s) result.idle_time[size_t(s)] = span - v * micro_batches * (kForwardTime + kBackwardTime);
  for (const auto& [key, channel] : channels)
    if (channel.sends.size() != channel.receives.size())
      return fail(key.first, std::to_string(channel.sends.size()) + " sends but " +
                                 std::to_string(channel.receives.size()) + " receives to stage " +
                                 std::to_string(key.second));
  result.completed = true;
  return result;
}

}  // namespace tessera::parallel
