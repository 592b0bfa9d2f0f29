// `tessera topo`: what this node has (GPUs, RDMA ports, interfaces, NUMA
// nodes) and the settings one node-local rank should run with (GPU, HCA and
// port, GPUDirect level, bootstrap interface, UCX/Open MPI, CPU binding),
// from parallel/topology.h.
//   tessera topo                                  a table, for the local rank the launcher announced (or 0 of 1)
//   tessera topo --format json                    the same as one JSON object
//   tessera topo --format env --local-rank 3      `export NAME='value'` lines (what scripts/tessera-rank evaluates)
//   tessera topo --sysfs-root tests/fixtures/topology/dgx8 --local-size 8
#pragma once

#include <CLI/CLI.hpp>

#include "parallel/topology.h"

namespace tessera::app {

// Adds the `topo` subcommand to `app`; it sets `exit_code` to 0. A sysfs root
// that does not exist, or a local rank outside the local size, is thrown as
// tessera::Error for main() to print.
void register_topo_command(CLI::App& app, int& exit_code);

// The decision as one JSON object (`--format json`): root, gpu_source, gpus,
// rdma_devices, interfaces, numa_nodes, allowed_cpus, and decision {local_rank,
// local_size, gpu, transport, rdma, socket_interface, numa_nodes, cpus,
// settings [{name, value, computed, kept, reason}], notes}.
std::string format_decision_json(const parallel::Topology& topology, const parallel::TopologyDecision& decision);

}  // namespace tessera::app
