// ExpertExchange: expert parallelism's token exchange. The E experts of a
// mixture-of-experts layer are split over the ep group of P ranks (rank q
// holds experts [q·E/P, (q+1)·E/P)); each rank routes its own tokens, and
// its slots (grouped by expert, parallel::MoePlan) travel to the ranks that
// hold their experts and come back after the experts ran:
//
//   ExpertExchange exchange(ep_group, E);
//   Tensor rows = exchange.dispatch(slots, plan.offsets);   // [R, C]: this rank's experts' rows from every rank
//   ... expert l runs on rows [local_offsets()[l], local_offsets()[l + 1]) ...
//   Tensor back = exchange.combine(outputs);                // [M, C]: the slots' outputs, where they were
//
// dispatch: one all-to-all of the per-expert row counts (E/P per pair of
// ranks), one of the rows (Communicator::all_to_all), then a gather
// (ops::moe_permute with one choice per row) that regroups what arrived
// source-major into expert-major order, so each local expert's rows are
// contiguous (its GEMMs run on them, from every source rank in rank order).
// combine is the inverse: the gather back to source-major order and the
// all-to-all in the other direction. The two are each other's adjoints, so
// a backward runs them swapped on the gradients (combine's gradient is a
// dispatch with the same counts). The counts of the last dispatch are kept
// for the combine that follows it. With a trace (the group's
// Communicator::events) each dispatch and combine is recorded as an
// "expert dispatch" / "expert combine" event of category comm.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "parallel/communicator.h"

namespace tessera::parallel {

class ExpertExchange {
 public:
  // Refuses E not divisible by the group's size, naming --num-experts and --expert-model-parallel-size.
  ExpertExchange(Communicator& group, int64_t num_experts);

  int64_t local_experts() const { return local_experts_; }
  int64_t first_expert() const { return int64_t(group_.rank()) * local_experts_; }

  // slots [M, C] grouped by expert, offsets [E + 1] (offsets[e]: expert e's
  // first slot) → this rank's experts' rows from every rank [R, C].
  // Collective over the group.
  Tensor dispatch(const Tensor& slots, const std::vector<int64_t>& offsets);
  // After dispatch: rows [R, C] in its order → the rows back on the ranks
  // and at the slots they came from [M, C]. Collective over the group.
  Tensor combine(const Tensor& rows);
  // After dispatch: local expert l's rows are [local_offsets()[l], local_offsets()[l + 1]).
  const std::vector<int64_t>& local_offsets() const { return local_offsets_; }

 private:
  Communicator& group_;
  int64_t num_experts_, local_experts_;
  // The last dispatch: rows sent to and received from each rank, the
  // regrouping's order (expert-major ← source-major) and its inverse.
  std::vector<int64_t> sent_rows_, received_rows_, local_offsets_;
  Tensor to_expert_order_, to_source_order_;
};

}  // namespace tessera::parallel
