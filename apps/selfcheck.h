// `tessera selfcheck`: every operator's backward against a directional
// derivative of its forward, and GPU against CPU where a GPU exists.
#pragma once

#include <cstdint>

namespace tessera::app {

struct SelfcheckOptions {
  uint64_t seed = 1234;
};

// Prints one line per operator; returns the process exit code (0 = all passed).
int run_selfcheck(const SelfcheckOptions& options);

}  // namespace tessera::app
