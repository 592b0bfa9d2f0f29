// The bytes of model state (parameters, gradients, optimizer state) one rank
// holds under each --zero stage, predicted from its sharding units before
// anything is allocated. `tessera train --estimate-memory` prints it; the
// tests hold it against the allocator's measured peaks per MemoryUse, which
// the trainer also writes into its metrics.
//
// With P the rank's parameter elements (its pipeline stage, its
// tensor-parallel shards), D the data-parallel ranks, b the bytes of a value
// (4 f32, 2 bf16/f16), S the optimizer's bytes per element (AdamW 8, SGD with
// momentum 4, plain SGD 0; + 4 for f32 masters when b < 4), N = --zero-prefetch
// and H the elements of units whose gradient lives through the whole
// backward (the tied embedding). While unit i runs backward, its values and
// those of the N units before it (gathered ahead) are there, and its
// gradient and those of the N units after it (reductions still in flight):
// U and G are those values' and gradients' elements (H left out) at the i
// where they weigh most (ZeRO-2 holds whole values: G alone decides):
//   zero 0: values bP,          gradients 4P,               optimizer SP
//   zero 1: values bP,          gradients 4P + 4P/D,        optimizer SP/D
//   zero 2: values bP,          gradients 4P/D + 4G + 4H,   optimizer SP/D
//   zero 3: values bP/D + bU,   gradients 4P/D + 4G + 4H,   optimizer SP/D
// and with gradient accumulation ZeRO-2/3 add 4G/D to the gradients: a
// later micro-batch's reduce-scatter lands in a temporary piece, added to the
// rank's own after it completes.
// (4P/D under ZeRO-1: the reduce-scatter's output beside the whole gradient;
// ZeRO-1/2 gather their values in place.) Pieces are padded to whole multiples of D; that padding is left
// out (at most D - 1 elements per bucket or unit).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "nn/optimizer.h"

namespace tessera::parallel {

struct MemoryPlanInput {
  std::vector<int64_t> unit_elements;  // this rank's sharding units, in parameter order
  std::vector<bool> unit_held;         // per unit: reduced after backward (counts in H, not U); empty: none
  int64_t value_bytes = 4;             // b
  int64_t optimizer_bytes = 8;         // S (see optimizer_bytes_per_element)
  int data_parallel = 1;               // D
  int zero_stage = 0;
  int prefetch = 1;         // N
  bool accumulates = false;  // more than one micro-batch a step
};

struct MemoryPlan {
  int64_t parameters = 0, gradients = 0, optimizer = 0;
  int64_t model_state() const { return parameters + gradients + optimizer; }
  // "values bP + bP/D = 4 x 34176 + 4 x 34176 / 4 = 170880; ..." (the formula with its numbers).
  std::string formula;
};

MemoryPlan predict_memory(const MemoryPlanInput& input);

// S: the optimizer state's bytes per parameter element for `config` with
// values of `dtype` (moments or momentum, and an f32 master unless f32).
int64_t optimizer_bytes_per_element(const nn::OptimizerConfig& config, DType dtype);

// "1.5 MiB" / "312 KiB" / "900 B".
std::string byte_text(int64_t bytes);

}  // namespace tessera::parallel
