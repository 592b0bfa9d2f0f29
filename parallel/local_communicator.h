// LocalCommunicator: a group of one process that needs no MPI: every
// collective is the identity (copies where input and output differ), send and
// recv have no peer and throw. The trainer uses it when a program runs without
// MPI initialised (in-process tests of `tessera train`), so the same
// data-parallel code path runs with dp = 1 at no cost.
#pragma once

#include <memory>
#include <string>

#include "parallel/communicator.h"

namespace tessera::parallel {

std::unique_ptr<Communicator> make_local_communicator(const std::string& name = "world");

}  // namespace tessera::parallel
