// A cluster described in a TOML file, for accelerators and networks that are
// not built in (`tessera plan --cluster my-cluster.toml`):
//
//   per_node = 8
//   nodes = 16
//   [accelerator]
//   base = "H100-SXM"           # optional: start from a built-in one
//   name = "H100-SXM-700W"
//   peak_flops_16 = 989e12      # dense bf16/fp16 FLOP/s
//   peak_flops_32 = 67e12
//   memory_gib = 79.1
//   memory_bandwidth = 3.35e12  # bytes/s
//   compute_units = 132
//   gemm_efficiency = 0.80      # achieved / peak for large GEMMs
//   memory_efficiency = 0.8
//   source = "where these came from"
//   [intra]                      # inside a node; or intra = "NVLink4"
//   bandwidth = 360e9            # bus bandwidth per GPU, bytes/s
//   latency = 2e-6               # seconds per ring step
//   [inter]                      # between nodes; or inter = "IB-NDR400x8"
//   bandwidth = 45e9
//   latency = 5e-6
//
// Unknown keys are refused with the file, line and the keys known.
//
// `tessera selfcheck --cluster` writes such a file from what it measured
// (write_cluster_file): every field of the Cluster, the accelerator's
// measured GEMM grids as [[accelerator.gemm_rates_32]] tables (m, n, k,
// flops), the links' sources, and for people a [selfcheck] table (results =
// the checks' lines) and [[link_samples]] tables (collective, link, ranks,
// bytes, seconds, bus_bandwidth), which the reader ignores.
#pragma once

#include <string>
#include <vector>

#include "plan/calibration.h"
#include "plan/cluster.h"

namespace tessera::app {

// Whether --cluster names a file (ends in .toml, or exists) rather than a SPEC.
bool names_cluster_file(const std::string& text);

plan::Cluster read_cluster_file(const std::string& path);

// Writes `cluster` to `path` (through path.partial, renamed) so that
// read_cluster_file gives it back (its spec aside: the path); `notes` go to
// [selfcheck] results, `samples` to [[link_samples]]. Throws tessera::Error
// naming the file when it cannot be written.
void write_cluster_file(const std::string& path, const plan::Cluster& cluster, const std::vector<std::string>& notes,
                        const std::vector<plan::LinkSample>& samples = {});

}  // namespace tessera::app
