// How `tessera plan` prints what it found: the ranking as a table, the best
// layout as name=value lines scripts read (predicted_step_s, ...), and one
// layout's breakdown (--explain).
#pragma once

#include <map>
#include <string>

#include "plan/cluster.h"
#include "plan/planner.h"

namespace tessera::plan {

// The `top` fastest layouts: rank, layout, step, tokens/s, TFLOP/s per GPU, MFU, memory.
std::string ranking_table(const SearchResult& result, size_t top);

// predicted_step_s=..., predicted_tokens_per_s, predicted_tflops_per_gpu,
// predicted_mfu, predicted_memory_bytes (the fullest rank),
// predicted_rank0_memory_bytes (world rank 0's: pipeline stage 0), predicted_fits,
// predicted_flags (the `tessera train` flags), one per line.
std::string name_values(const Prediction& prediction);

// name=value lines back into a map (what a script does with name_values).
std::map<std::string, std::string> parse_name_values(const std::string& text);

// Where the step's time goes and what the fullest rank's memory holds.
std::string explain(const Prediction& prediction, const Cluster& cluster);

}  // namespace tessera::plan
