// What `tessera selfcheck --cluster` measures on an allocation for `tessera
// plan --cluster FILE`: this machine's accelerator as the planner sees it
// (GEMM FLOP/s by shape and precision, memory-bound bandwidth, the fused
// attention's FLOP/s, what one kernel call costs), measured on every rank at
// once so that ranks sharing cores and memory are measured as they train;
// and the links (bus bandwidth and latency per link class, by collective and
// size, as nccl-tests report them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/context.h"
#include "parallel/communicator.h"
#include "plan/cluster.h"

namespace tessera::plan {

// Compute: every rank runs the same measurements at the same time; the
// figures are the ranks' medians. Fills cluster.accelerator (name "cpu" or
// the device's, peaks = the best measured GEMM rate per precision, gemm
// tables, memory bandwidth, attention efficiency, launch seconds, source).
// `quick`: fewer shapes and repeats (the tests).
Accelerator measure_compute(Context& ctx, parallel::Communicator& world, bool quick = false);

// One timed collective.
struct LinkSample {
  std::string collective;  // "all_reduce", "all_gather", "reduce_scatter", "send_recv"
  std::string link;        // "intra" or "inter"
  int ranks = 0;           // group size
  double bytes = 0;    // the whole tensor's (all_reduce, all_gather's output, reduce_scatter's input), or one message
  double seconds = 0;  // median
  double bus_bandwidth = 0;  // bytes/s, as nccl-tests compute it
};

struct LinkCalibration {
  Link intra, inter;                                    // fitted α (latency per ring step) and β (bus bandwidth)
  bool intra_measured = false, inter_measured = false;  // false: no group of that class (one rank per node, one node)
  std::vector<LinkSample> samples;
};

// Links: collectives over groups inside a node and across nodes (one rank
// per node), sizes 4 KiB to 64 MiB (`quick`: to 1 MiB, fewer repeats), send/
// recv between neighbours; α and β fitted per link class by least squares on
// t = steps·α + traffic/β. `ranks_per_node`: from the launcher (MpiEnv).
// Collective over `world`.
LinkCalibration measure_links(parallel::Communicator& world, int ranks_per_node, bool quick = false);

}  // namespace tessera::plan
