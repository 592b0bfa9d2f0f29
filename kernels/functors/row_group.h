// Row-wise operators (softmax, norms, cross-entropy) are written once as
// "row functors": `op(group, row)` processes one row with a group of
// cooperating lanes. The functor loops over its elements in lane-strided
// steps and combines partial results with the group's reductions:
//
//   for (int64_t i = g.lane(); i < D; i += kGroupLanes<Group>) partial += x[i];
//   const float total = g.sum(partial);   // every lane gets the total
//
// SerialGroup (below) is the CPU's: one lane, reductions are the identity,
// and the loops compile to plain vectorisable loops. The CUDA backend's
// WarpGroup (kernels/cuda/row_launch.cuh) is 32 lanes reducing with shuffles.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace tessera {

struct SerialGroup {
  static TESSERA_HD constexpr int size() { return 1; }
  static constexpr int lane() { return 0; }
  TESSERA_HD float sum(float v) const { return v; }
  TESSERA_HD float max(float v) const { return v; }
};

// A group's lane count as a compile-time constant, for loop strides and
// template arguments in functors that run on both backends.
template <typename Group>
inline constexpr int64_t kGroupLanes = Group::size();

}  // namespace tessera
