// What the MPI test binary (tests/mpi/, run under mpiexec) shares with its
// tests: the process's MpiEnv, made by test_main.cpp before any test runs.
// Every rank runs every test; tests must run the same collectives on every
// rank (use EXPECT_, not ASSERT_, before a collective, so that a failing rank
// does not leave its peers waiting).
#pragma once

#include <memory>

#include "core/context.h"
#include "parallel/communicator.h"
#include "parallel/mpi_env.h"

namespace tessera::testing {

parallel::MpiEnv& mpi_env();

// A communicator over MPI_COMM_WORLD for a test.
std::unique_ptr<parallel::Communicator> world();

// Ranks share this machine's cores: one OpenMP thread each.
ContextOptions one_thread();

}  // namespace tessera::testing
