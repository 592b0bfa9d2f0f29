// Ranks started alike: before the first collective of a run, every rank
// compares what it was given with the others (apps/trainer.cpp calls this),
// so a launch script that hands ranks different flags, or nodes holding
// different copies of the data, fails at once with the differences named,
// instead of training different models or hanging in a collective.
#pragma once

#include <optional>

#include "apps/train_config.h"
#include "io/dataset.h"
#include "parallel/communicator.h"

namespace tessera::app {

// Collective over `world`. Compares every setting of `config` except those
// that may differ between nodes (CPU threads, the device string, the
// --config file's path, the data files' paths, where metrics and traces
// go), what the data files hold (`data`, `eval`: their descriptions), and
// the tessera version. On any difference throws, alike on every rank,
// naming each setting and which ranks hold which value.
void check_ranks_agree(parallel::Communicator& world, const TrainConfig& config,
                       const std::optional<io::DatasetInfo>& data, const std::optional<io::DatasetInfo>& eval);

}  // namespace tessera::app
