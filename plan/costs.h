// The planner's unit costs: how long one GEMM, one memory-bound kernel and one
// collective take on a cluster (plan/cluster.h), from their FLOPs and bytes.
//
//   GEMM [m×k]·[k×n]: 2mnk FLOPs at the accelerator's peak times its GEMM
//     efficiency, stretched by wave quantisation (the output's tiles run in
//     whole waves over the compute units), or its bytes at the memory
//     bandwidth if that is slower (a roofline), plus one launch.
//   memory-bound kernel: its bytes at the achieved bandwidth, plus launches.
//   collectives over n ranks, ring algorithms (α–β: α per ring step, β the
//     bus bandwidth of the link class the group crosses):
//       all-reduce          2(n−1)/n · B/β + 2(n−1)·α, or a tree's
//                           2·B/β + 2·⌈log₂ n⌉·α when that is less (small
//                           messages over many ranks: NCCL picks the tree)
//       reduce-scatter,
//       all-gather          (n−1)/n · B/β + (n−1)·α      (B: the whole tensor)
//       all-to-all          (n−1)/n · B/β + (n−1)·α      (B: one rank's part)
//       send/recv           B/β + α
//
// Which link a group crosses follows the rank order (tp fastest, then cp, ep,
// dp, pp): a group of `size` ranks `stride` apart stays inside a node when it
// spans at most one node's ranks; otherwise a ring crosses nodes, where the
// group's members on one node share their NICs: β = min(intra, members·inter).
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "plan/cluster.h"

namespace tessera::plan {

double gemm_seconds(const Accelerator& a, DType dtype, int64_t m, int64_t n, int64_t k);
double memory_seconds(const Accelerator& a, double bytes, int kernels = 1);

// A communicator group's place in the cluster.
struct GroupLink {
  int size = 1;
  double bandwidth = 0;  // bus bandwidth β, bytes/s
  double latency = 0;    // α per ring step
  bool crosses_nodes = false;
};
GroupLink group_link(const Cluster& cluster, int size, int stride);

double all_reduce_seconds(const GroupLink& g, double bytes);
double reduce_scatter_seconds(const GroupLink& g, double bytes);  // also all-gather
double all_to_all_seconds(const GroupLink& g, double bytes);
double send_seconds(const GroupLink& g, double bytes);

}  // namespace tessera::plan
