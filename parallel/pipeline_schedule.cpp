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
  if (op == Op::forward) {
    out << "F" << micro;
  } else if (op == Op::backward) {
    out << "B" << micro;
  } else {
    out << "X[";
    for (size_t i = 0; i < transfers.size(); ++i) {
      const PipeTransfer& t = transfers[i];
      out << (i ? ", " : "") << (t.is_send() ? "send " : "recv ")
          << (t.kind == PipeTransfer::Kind::send_activation || t.kind == PipeTransfer::Kind::recv_activation ? "act "
                                                                                                             : "grad ")
          << t.micro;
    }
    out << "]";
  }
  return out.str();
}

namespace {

using Kind = PipeTransfer::Kind;

// Appends an exchange of the transfers that apply (a stage without a
// previous or next neighbour drops the transfers towards it).
void exchange(std::vector<PipeInstruction>& list, int stage, int stages, std::vector<PipeTransfer> transfers) {
  std::vector<PipeTransfer> kept;
  for (const PipeTransfer& t : transfers) {
    const bool has_neighbour = t.to_next() ? stage + 1 < stages : stage > 0;
    if (has_neighbour) kept.push_back(t);
  }
  if (kept.empty()) return;
  PipeInstruction instruction;
  instruction.op = PipeInstruction::Op::exchange;
  instruction.transfers = std::move(kept);
  list.push_back(std::move(instruction));
}

void compute(std::vector<PipeInstruction>& list, PipeInstruction::Op op, int micro) {
  PipeInstruction instruction;
  instruction.op = op;
  instruction.micro = micro;
  list.push_back(instruction);
}

}  // namespace

std::vector<PipeInstruction> pipeline_schedule(PipelineScheduleKind kind, int stages, int stage, int micro_batches) {
  TESSERA_CHECK(stages >= 1 && stage >= 0 && stage < stages && micro_batches >= 1, "pipeline schedule: stage ", stage,
                " of ", stages, " with ", micro_batches, " micro-batch(es) does not exist");
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

// One direction of one link: activations s → s+1 or gradients s+1 → s.
struct Channel {
  struct Posted {
    int stage, micro, time;
  };
  std::vector<Posted> sends, receives;  // in posting order; the k-th send pairs with the k-th receive
};

}  // namespace

PipelineSimulation simulate_pipeline(const std::vector<std::vector<PipeInstruction>>& lists, int micro_batches) {
  const int p = int(lists.size());
  constexpr int kForwardTime = 1, kBackwardTime = 2;
  PipelineSimulation result;
  result.max_in_flight.assign(size_t(p), 0);
  result.finish_time.assign(size_t(p), 0);
  result.idle_time.assign(size_t(p), 0);
  // Channel key: (lower stage, activation?) — activations lower → upper, gradients upper → lower.
  std::map<std::pair<int, bool>, Channel> channels;
  struct StageState {
    size_t pc = 0;
    int clock = 0;
    bool posted = false;                            // the current exchange's transfers are posted
    std::vector<std::pair<Channel*, size_t>> mine;  // (channel, index in its sends/receives) of the current exchange
    std::vector<bool> mine_is_send;
    std::vector<bool> forwarded, backwarded, activation_in, gradient_in;
    int in_flight = 0;
  };
  std::vector<StageState> state(static_cast<size_t>(p));
  for (auto& st : state) {
    st.forwarded.assign(size_t(micro_batches), false);
    st.backwarded.assign(size_t(micro_batches), false);
    st.activation_in.assign(size_t(micro_batches), false);
    st.gradient_in.assign(size_t(micro_batches), false);
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
          const int mb = in.micro;
          if (mb < 0 || mb >= micro_batches) return fail(s, in.to_string() + " names no micro-batch");
          if (in.op == PipeInstruction::Op::forward) {
            if (st.forwarded[size_t(mb)]) return fail(s, in.to_string() + " runs twice");
            if (s > 0 && !st.activation_in[size_t(mb)])
              return fail(s, in.to_string() + " runs before its activation arrived");
            st.forwarded[size_t(mb)] = true;
            result.max_in_flight[size_t(s)] = std::max(result.max_in_flight[size_t(s)], ++st.in_flight);
            st.clock += kForwardTime;
          } else {
            if (!st.forwarded[size_t(mb)]) return fail(s, in.to_string() + " runs before its forward");
            if (st.backwarded[size_t(mb)]) return fail(s, in.to_string() + " runs twice");
            if (s + 1 < p && !st.gradient_in[size_t(mb)])
              return fail(s, in.to_string() + " runs before its gradient arrived");
            st.backwarded[size_t(mb)] = true;
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
            const bool activation = t.kind == Kind::send_activation || t.kind == Kind::recv_activation;
            const int neighbour = t.to_next() ? s + 1 : s - 1;
            if (neighbour < 0 || neighbour >= p)
              return fail(s, in.to_string() + " talks to a stage that does not exist");
            Channel& channel = channels[{std::min(s, neighbour), activation}];
            auto& side = t.is_send() ? channel.sends : channel.receives;
            side.push_back({s, t.micro, st.clock});
            st.mine.emplace_back(&channel, side.size() - 1);
            st.mine_is_send.push_back(t.is_send());
            if (t.is_send()) {
              const bool have = activation ? st.forwarded[size_t(t.micro)] : st.backwarded[size_t(t.micro)];
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
          if (other[index].micro != mine.micro)
            return fail(s, in.to_string() + " pairs with micro-batch " + std::to_string(other[index].micro) +
                               " on stage " + std::to_string(other[index].stage));
          done_at = std::max(done_at, other[index].time);
        }
        if (!complete) break;
        for (const PipeTransfer& t : in.transfers) {
          if (t.kind == Kind::recv_activation) st.activation_in[size_t(t.micro)] = true;
          if (t.kind == Kind::recv_gradient) st.gradient_in[size_t(t.micro)] = true;
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
    for (int mb = 0; mb < micro_batches; ++mb)
      if (!st.forwarded[size_t(mb)] || !st.backwarded[size_t(mb)])
        return fail(s, "micro-batch " + std::to_string(mb) + " is not run forward and backward");
    result.finish_time[size_t(s)] = st.clock;
  }
  // Idle: the step's span (the last stage to finish) minus the stage's own work.
  const int span = *std::max_element(result.finish_time.begin(), result.finish_time.end());
  for (int s = 0; s < p; ++s) result.idle_time[size_t(s)] = span - micro_batches * (kForwardTime + kBackwardTime);
  for (const auto& [key, channel] : channels)
    if (channel.sends.size() != channel.receives.size())
      return fail(key.first, std::to_string(channel.sends.size()) + " sends but " +
                                 std::to_string(channel.receives.size()) + " receives on a link");
  result.completed = true;
  return result;
}

}  // namespace tessera::parallel
