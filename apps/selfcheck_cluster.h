// `tessera selfcheck --cluster`: the acceptance check of an allocation, run
// on every rank under mpirun, srun or an MPIJob (or alone). It checks that
// every rank computes the same GEMM and attention bit for bit, that every
// ring link delivers a payload unchanged, and that training a small GPT under
// each layout the world fits (tp, pp, tp × pp, ZeRO 1-3, cp) gives the
// data-parallel layout's losses; then it measures the machine
// (plan::measure_compute) and the links (plan::measure_links) and writes the
// cluster file `tessera plan --cluster FILE` reads. A check that fails names
// the rank, the pair of ranks or the layout, and makes the exit status 1 on
// every rank.
#pragma once

#include <cstdint>
#include <string>

#include "parallel/mpi_env.h"

namespace tessera::app {

struct ClusterSelfcheckOptions {
  std::string output = "tessera-cluster.toml";  // --output: the cluster file rank 0 writes
  bool quick = false;                           // --quick: fewer sizes and repeats (tests, a first look)
  uint64_t seed = 1234;                         // --seed: the inputs of the checks
  int threads =
      0;  // --threads: CPU threads per rank while calibrating, as `tessera train --threads` (0: OpenMP's default)
};

// Runs the checks and the calibration on the ranks of `env`'s world; prints
// progress and a summary on rank 0; returns the exit status (0: every check
// passed and the file was written), the same on every rank.
int run_cluster_selfcheck(const ClusterSelfcheckOptions& options, const parallel::MpiEnv& env);

}  // namespace tessera::app
