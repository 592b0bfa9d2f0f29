// Node topology and the network settings each rank should run with.
//
// A job on a GPU cluster is only fast when every rank talks through the right
// NIC: the InfiniBand or RoCE port nearest its GPU, GPUDirect RDMA where the
// PCIe path allows it, TCP only where nothing better exists. This file finds
// what a node has, from sysfs and procfs under a root directory ("/" on a real
// node, a fixture tree in tests), and decides, per node-local rank, the GPU,
// the RDMA port(s), the CPUs to run on, and the NCCL, UCX and Open MPI
// variables that say so. It is what `tessera topo` prints and what
// scripts/tessera-rank exports before it starts `tessera train`.
//
//   Topology node = discover_topology("/");
//   TopologyDecision d = decide_topology(node, {.local_rank = 1, .local_size = 8}, process_environment());
//   std::puts(format_decision_env(node, d).c_str());   // export NCCL_IB_HCA==mlx5_1:1 ...
//
// Discovery reads (all relative to the root):
//   sys/bus/pci/devices/*          GPUs: class 0x0302xx/0x0300xx with vendor 0x10de; numa_node;
//                                  the symlink's target is the device's PCIe path
//   sys/class/infiniband/*         RDMA devices: device -> PCI function, device/net/* (netdevs),
//                                  ports/N/{state,rate,link_layer}, ports/N/gids/* and
//                                  ports/N/gid_attrs/types/* (RoCE v2 GID indices)
//   sys/class/net/*                interfaces: operstate, type, whether they sit on a device
//   sys/devices/system/node/node*  NUMA nodes and their cpulists (sys/devices/system/cpu/online without)
//   proc/net/route                 which interfaces carry IPv4 routes, and the default route
//   proc/self/status               the CPUs this process may run on (Cpus_allowed_list)
// On the real root, NVML (libnvidia-ml.so.1, loaded at run time when present;
// nothing is linked) lists the GPUs this process can use (in a container,
// fewer than sysfs shows); sysfs supplies their NUMA nodes and PCIe paths.
//
// The decision is a pure function of the topology, the rank's place and the
// environment: variables already exported win over computed ones, and the
// decision says which were kept.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace tessera::parallel {

// How a GPU and a NIC are connected, nearest first. NCCL names the levels
// PIX, PXB, PHB and SYS (see nccl_level()).
enum class PcieRelation {
  same_switch,       // PIX: below one PCIe switch (or functions of one device)
  switch_hierarchy,  // PXB: through several switches, without the host bridge
  root_complex,      // PHB: one root complex, through its host bridge
  numa_node,         // PHB: different root complexes of one NUMA node (one CPU socket)
  system,            // SYS: across the SMP interconnect between NUMA nodes
};

// "PIX", "PXB", "PHB", "PHB", "SYS".
const char* nccl_level(PcieRelation relation);
// "same PCIe switch", "PCIe switches below one root port", "same root complex",
// "same NUMA node", "across NUMA nodes".
const char* describe(PcieRelation relation);

struct PciLocation {
  std::string address;            // "0000:18:00.0"
  std::vector<std::string> path;  // from the root complex down: {"pci0000:10", "0000:10:01.1", ..., address}
  int numa_node = -1;             // -1: the kernel does not know
};

// How `a` and `b` are connected, from their PCIe paths and NUMA nodes.
// `numa_nodes` is the node's count of NUMA nodes (unknown nodes on a machine
// of one NUMA node are that node).
PcieRelation pcie_relation(const PciLocation& a, const PciLocation& b, int numa_nodes);

struct Gpu {
  int index = 0;          // in PCI bus order, as NVML and CUDA_DEVICE_ORDER=PCI_BUS_ID number them
  std::string device_id;  // PCI device id, e.g. "0x20b2"
  PciLocation pci;
};

struct RdmaPort {
  int number = 1;
  std::string state;           // "ACTIVE", "DOWN", "INIT", ...
  std::string link_layer;      // "InfiniBand" or "Ethernet" (RoCE)
  std::string rate;            // "200 Gb/sec (4X HDR)"
  double gbps = 0;             // 200
  int roce_v2_gid_index = -1;  // RoCE only: the GID index NCCL_IB_GID_INDEX should name, -1 if none
  bool active() const { return state == "ACTIVE"; }
  bool roce() const { return link_layer == "Ethernet"; }
};

struct RdmaDevice {
  std::string name;  // "mlx5_0"
  PciLocation pci;
  std::vector<RdmaPort> ports;
  std::vector<std::string> netdevs;  // the interfaces of the same PCI function ("ib0", "ens5f0np0")
};

struct NetInterface {
  std::string name;
  std::string operstate;       // "up", "down", "unknown" (loopback), ...
  bool up = false;             // operstate "up"
  bool on_device = false;      // backed by hardware (not lo, a bridge, a tunnel)
  bool has_route = false;      // an IPv4 route names it in proc/net/route
  bool default_route = false;  // it carries the default route
  int type = 0;                // ARPHRD: 1 Ethernet, 32 InfiniBand (IPoIB), 772 loopback
  std::string rdma_device;     // the RDMA device on the same PCI function, or ""
};

struct NumaNode {
  int id = 0;
  std::vector<int> cpus;
};

struct Topology {
  std::string root;                      // what was read: "/" or a fixture tree
  std::string gpu_source = "sysfs";      // "sysfs" or "NVML"
  std::vector<Gpu> gpus;                 // by index
  std::vector<RdmaDevice> rdma_devices;  // by name
  std::vector<NetInterface> interfaces;  // by name
  std::vector<NumaNode> numa_nodes;      // by id; one node holding every CPU when sysfs has none
  std::vector<int> allowed_cpus;         // this process's CPU affinity; empty: every CPU
  std::vector<std::string> notes;        // what discovery noticed (e.g. NVML and sysfs disagreeing)
};

struct DiscoveryOptions {
  // GPUs by PCI address as NVML lists them; when given, only these count as
  // GPUs. Unset: NVML is asked when the root is "/" and its library loads.
  std::optional<std::vector<std::string>> gpu_addresses;
  bool use_nvml = true;
};

// Reads the topology under `root`. Missing subsystems (no GPUs, no
// /sys/class/infiniband, no NUMA directory) are normal and leave those lists
// empty; a root that does not exist or is not a directory throws
// tessera::Error naming it.
Topology discover_topology(const std::string& root, const DiscoveryOptions& options = {});

// The PCI addresses of the GPUs NVML lists (in its order), or nothing when
// libnvidia-ml.so.1 is absent or fails to start.
std::optional<std::vector<std::string>> nvml_gpu_addresses();

using Environment = std::map<std::string, std::string>;

// This process's environment.
Environment process_environment();

// The node-local rank and rank count as launchers announce them
// (OMPI_COMM_WORLD_LOCAL_RANK/SIZE from mpirun; SLURM_LOCALID with
// SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE and SLURM_NODEID from srun;
// MPI_LOCALRANKID/MPI_LOCALNRANKS from Hydra; PMIX_LOCAL_RANK/PMIX_LOCAL_SIZE),
// or nothing when none is set. A malformed value throws tessera::Error naming it.
std::optional<int> local_rank_from_environment(const Environment& environment);
std::optional<int> local_size_from_environment(const Environment& environment);

struct RankPlacement {
  int local_rank = 0;
  int local_size = 1;
};

// One environment variable of the decision.
struct Setting {
  std::string name;
  std::string value;     // what will be in effect: the environment's when kept, else computed
  std::string computed;  // what the topology asks for
  bool kept = false;     // the environment already had it: its value wins
  std::string reason;    // why the computed value
};

struct RdmaChoice {
  std::string device;  // "mlx5_0"
  int port = 1;
  bool roce = false;
  double gbps = 0;
  std::optional<PcieRelation> relation;  // to the rank's GPU; nothing for CPU ranks
};

struct TopologyDecision {
  RankPlacement placement;
  std::optional<int> gpu;          // index into Topology::gpus, nothing on a CPU-only node
  std::vector<RdmaChoice> rdma;    // nearest active ports first; empty: TCP
  std::string transport;           // "InfiniBand", "RoCE" or "TCP"
  std::string socket_interface;    // bootstrap / TCP interface, "" when none is usable
  std::vector<int> numa_nodes;     // where the rank's CPUs are
  std::vector<int> cpus;           // the CPUs to bind to (within the allowed ones); empty: no binding
  std::vector<Setting> settings;   // in output order
  std::vector<std::string> notes;  // fallbacks, shared GPUs, kept variables

  const Setting* find(const std::string& name) const;
  // The value in effect for `name`, or "" when the decision does not set it.
  std::string value(const std::string& name) const;
};

// The decision for one node-local rank. Throws tessera::Error when the
// placement is impossible (local_rank outside [0, local_size)).
TopologyDecision decide_topology(const Topology& topology, RankPlacement placement, const Environment& environment);

// "0-3,8,10-11" from a sorted list; "" for none.
std::string format_cpu_list(const std::vector<int>& cpus);
// The inverse, as the kernel writes them ("0-31,64-95"); throws on bad text, naming `what`.
std::vector<int> parse_cpu_list(const std::string& text, const std::string& what);

// A human table: GPUs, RDMA devices and ports, interfaces, NUMA nodes, then
// the decision with each variable and where it comes from.
std::string format_topology_table(const Topology& topology, const TopologyDecision& decision);
// Shell lines for a launch wrapper: a comment per decision line and one
// `export NAME='value'` per computed variable (kept ones as comments).
std::string format_decision_env(const Topology& topology, const TopologyDecision& decision);
// A few lines for a training log: the GPU, NIC and CPUs, and each variable with its origin.
std::string summarize_decision(const Topology& topology, const TopologyDecision& decision);

// For `tessera train` to log on rank 0: discovers the node under
// `sysfs_root`, decides for `local_rank` of `local_size` with this process's
// environment, and summarizes it (summarize_decision). Lines start with
// "topology: ". Throws tessera::Error only when `sysfs_root` is unreadable.
std::string describe_topology_decision(int local_rank, int local_size, const std::string& sysfs_root = "/");

}  // namespace tessera::parallel
