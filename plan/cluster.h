// What `tessera plan` knows of a cluster: its accelerator (peak FLOP/s per
// precision, memory size and bandwidth, and the calibration that turns peaks
// into achieved rates), how many per node and how many nodes, and the two
// link classes a collective can cross (inside a node, between nodes).
//
// Built-in accelerators (A100-40GB, A100-80GB, H100-SXM, H200, B200, cpu) and
// links (NVLink3/4/5, PCIe4/5, IB-HDR200, IB-NDR400, RoCE-*, Ethernet-*,
// shm) carry their datasheet figures and one calibration each, with where it
// came from (`source`). A SPEC names them:
//
//   [N x]ACCELERATOR[:INTRA[,INTER[xNICS]]][:nodes=K]
//   8xH100-SXM:NVLink4,IB-NDR400x8:nodes=64     512 H100s, 8 per node, 8 NDR NICs per node
//   A100-80GB                                  one GPU
//   2xcpu:shm                                  two CPU ranks on one node
//
// A TOML file (apps/ reads it: toml++ lives there) and a calibration file
// written by `tessera selfcheck --cluster` fill the same struct.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace tessera::plan {

// A GEMM's measured rate: [m×k]·[k×n] at `flops` FLOP/s.
struct GemmRate {
  int64_t m = 0, n = 0, k = 0;
  double flops = 0;
};

struct Accelerator {
  std::string name;                    // "H100-SXM"
  double peak_flops_16 = 0;            // dense bf16/fp16 FLOP/s (tensor cores)
  double peak_flops_32 = 0;            // dense fp32 FLOP/s (what f32 GEMMs run at)
  int64_t memory_bytes = 0;            // usable by the framework
  double memory_bandwidth = 0;         // bytes/s, peak
  int compute_units = 1;               // SMs (GPU) or cores: GEMM tiles run in waves over them
  int64_t tile_m = 128, tile_n = 128;  // a GEMM's output tile per compute unit
  // Calibration: the share of peak that large GEMMs reach (the maximum
  // achievable matmul FLOP/s over peak), the share of peak bandwidth that
  // memory-bound kernels reach, and what launching one kernel costs.
  double gemm_efficiency = 0.8;
  double attention_efficiency = 0.35;  // a fused attention kernel's FLOP/s over peak (forward and backward)
  double memory_efficiency = 0.8;
  double launch_seconds = 5e-6;
  // Measured GEMM rates on a grid of shapes (`tessera selfcheck --cluster`),
  // per precision; when present they replace peak × gemm_efficiency and the
  // wave model: a shape's rate is interpolated on the grid (log-space).
  std::vector<GemmRate> gemm_rates_32, gemm_rates_16;
  std::string source;  // where the peaks and the calibration came from
  double peak_flops(DType dtype) const { return dtype == DType::f32 ? peak_flops_32 : peak_flops_16; }
};

struct Link {
  std::string name;  // "NVLink4", "IB-NDR400x8"
  double bandwidth =
      0;  // bytes/s one GPU can send and receive at once over this link class (bus bandwidth a ring reaches)
  double latency = 0;  // seconds per step of a ring (one hop)
  std::string source;
};

struct Cluster {
  Accelerator accelerator;
  int per_node = 1, nodes = 1;
  Link intra, inter;  // inside a node, between nodes (inter: bandwidth per GPU of the node's NICs)
  std::string spec;   // as given ("8xH100-SXM:NVLink4,IB-NDR400x8:nodes=64")
  int world() const { return per_node * nodes; }
  std::string describe() const;  // one line: what it is, with the figures used
};

// The built-in accelerators, by name (case-insensitive; "H100" means H100-SXM).
const std::vector<Accelerator>& accelerators();
const Accelerator& accelerator_named(std::string_view name);

// A link by name ("NVLink4", "IB-NDR400x8": x8 NICs per node, shared by
// `per_node` GPUs; "PCIe5", "RoCE-400x4", "Ethernet-100G", "shm").
Link link_named(std::string_view name, int per_node);

// Parses a SPEC (see the top of this file); throws tessera::Error saying what
// part is wrong and what is accepted (the accelerators' and links' names).
Cluster parse_cluster(std::string_view spec);

}  // namespace tessera::plan
