// libFuzzer harness: the node topology reader (parallel/topology.h) on a
// fuzz-built sysfs/procfs tree and a fuzzed launcher environment. The fuzz
// bytes choose GPUs and RDMA NICs with their PCIe paths (root complexes,
// switches, NUMA nodes), RDMA ports (state, rate, link layer, GID tables),
// network interfaces, NUMA nodes' CPU lists, the allowed CPUs, the routing
// table, and the contents of every one of those files, valid or not; links
// may dangle or loop. The environment is any launcher's variables or srun's
// (node id, local id, task counts per node like "2(x3),1"). The harness discovers the topology (NVML off), reads
// the local rank and size from the environment, decides for every local
// rank and prints the decision in each of its forms. Arbitrary sysfs content
// must end in tessera::Error or in a decision, never a crash, a hang, a huge
// allocation or undefined behaviour.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "parallel/topology.h"

namespace {

using namespace tessera;
using namespace tessera::fuzz;

class TreeBuilder {
 public:
  TreeBuilder(FuzzedDataProvider& data, fs::path root) : data_(data), root_(std::move(root)) {}

  const fs::path& root() const { return root_; }

  // A file with `valid` text (choice 0), fuzzed text, valid text with
  // trailing junk, or no file at all.
  void attribute(const fs::path& path, const std::string& valid) {
    fs::create_directories(path.parent_path());
    switch (data_.ConsumeIntegralInRange<int>(0, 5)) {
      case 3:
        write_file(path, data_.ConsumeRandomLengthString(48));
        return;
      case 4:
        write_file(path, valid + data_.ConsumeRandomLengthString(8));
        return;
      case 5:
        return;
      default:
        write_file(path, valid + "\n");
        return;
    }
  }

  // A symbolic link `link` -> `target` (relative, as sysfs makes them), or
  // one that dangles or points at itself.
  void link(const fs::path& link, const fs::path& target) {
    fs::create_directories(link.parent_path());
    std::error_code ignored;
    switch (data_.ConsumeIntegralInRange<int>(0, 7)) {
      case 6:
        fs::create_symlink("../nowhere/at/all", link, ignored);
        return;
      case 7:
        fs::create_symlink(link.filename(), link, ignored);
        return;  // a loop
      default:
        fs::create_symlink(target.lexically_relative(link.parent_path()), link, ignored);
        return;
    }
  }

  // A PCI function under a root complex and 0-3 bridges chosen so devices
  // can share switches; returns its sysfs directory.
  fs::path pci_device(int serial) {
    const int complex = data_.ConsumeIntegralInRange<int>(0, 1);
    fs::path dir = root_ / "sys/devices" / ("pci0000:" + hex2(complex * 0x80));
    const int depth = data_.ConsumeIntegralInRange<int>(0, 3);
    for (int d = 0; d < depth; ++d)
      dir /= "0000:" + hex2(complex * 0x80 + d * 0x10 + data_.ConsumeIntegralInRange<int>(0, 1)) + ":00.0";
    dir /= "0000:" + hex2(complex * 0x80 + 0x40 + serial) + ":00.0";
    fs::create_directories(dir);
    attribute(dir / "numa_node", std::to_string(complex));
    return dir;
  }

  std::string cpu_list() {
    const int first = data_.ConsumeIntegralInRange<int>(0, 64);
    const int last = first + data_.ConsumeIntegralInRange<int>(0, 16);
    return std::to_string(first) + "-" + std::to_string(last) + (data_.ConsumeBool() ? ",80" : "");
  }

  static std::string hex2(int value) {
    char text[8];
    std::snprintf(text, sizeof text, "%02x", value & 0xff);
    return text;
  }

 private:
  FuzzedDataProvider& data_;
  fs::path root_;
};

void build_tree(FuzzedDataProvider& data, TreeBuilder& tree) {
  const fs::path& root = tree.root();
  int serial = 0;
  const int gpus = data.ConsumeIntegralInRange<int>(0, 4);
  for (int g = 0; g < gpus; ++g) {
    const fs::path dir = tree.pci_device(serial++);
    tree.attribute(dir / "vendor", "0x10de");
    tree.attribute(dir / "class", data.ConsumeBool() ? "0x030200" : "0x030000");
    tree.attribute(dir / "device", "0x20b2");
    tree.link(root / "sys/bus/pci/devices" / dir.filename(), dir);
  }
  const int nics = data.ConsumeIntegralInRange<int>(0, 3);
  std::vector<std::string> netdevs;
  for (int n = 0; n < nics; ++n) {
    const fs::path dir = tree.pci_device(serial++);
    tree.attribute(dir / "vendor", "0x15b3");
    tree.attribute(dir / "class", "0x020700");
    tree.link(root / "sys/bus/pci/devices" / dir.filename(), dir);
    const fs::path ib = root / "sys/class/infiniband" / ("mlx5_" + std::to_string(n));
    fs::create_directories(ib);
    tree.link(ib / "device", dir);
    const bool roce = data.ConsumeBool();
    const std::string netdev = roce ? "ens" + std::to_string(n) + "np0" : "ib" + std::to_string(n);
    fs::create_directories(dir / "net" / netdev);
    netdevs.push_back(netdev);
    const int ports = data.ConsumeIntegralInRange<int>(1, 2);
    for (int p = 1; p <= ports; ++p) {
      const fs::path port = ib / "ports" / std::to_string(p);
      tree.attribute(port / "state", data.ConsumeBool() ? "4: ACTIVE" : "1: DOWN");
      tree.attribute(port / "rate", "200 Gb/sec (4X HDR)");
      tree.attribute(port / "link_layer", roce ? "Ethernet" : "InfiniBand");
      const int gids = roce ? data.ConsumeIntegralInRange<int>(0, 3) : 0;
      for (int i = 0; i < gids; ++i) {
        const std::string index = std::to_string(i);
        tree.attribute(port / "gid_attrs/types" / index, data.ConsumeBool() ? "RoCE v2" : "IB/RoCE v1");
        tree.attribute(port / "gids" / index,
                       i == 0 ? "fe80:0000:0000:0000:0000:0000:0000:0001" : "0000:0000:0000:0000:0000:ffff:c0a8:0001");
      }
    }
  }
  const int plain = data.ConsumeIntegralInRange<int>(0, 2);
  for (int e = 0; e < plain; ++e) netdevs.push_back("eno" + std::to_string(e));
  netdevs.push_back("lo");
  std::string routes = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT\n";
  for (const std::string& name : netdevs) {
    const fs::path dir = root / "sys/class/net" / name;
    fs::create_directories(dir);
    tree.attribute(dir / "operstate", name == "lo" ? "unknown" : data.ConsumeBool() ? "up" : "down");
    tree.attribute(dir / "type", name == "lo" ? "772" : name.starts_with("ib") ? "32" : "1");
    if (name != "lo" && data.ConsumeBool()) tree.link(dir / "device", root / "sys/devices");
    if (data.ConsumeBool())
      routes += name + (data.ConsumeBool() ? "\t00000000\t0101A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
                                           : "\t0001A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n");
  }
  if (data.ConsumeBool()) routes += data.ConsumeRandomLengthString(64);
  tree.attribute(root / "proc/net/route", routes);

  const int numa = data.ConsumeIntegralInRange<int>(0, 3);
  for (int n = 0; n < numa; ++n)
    tree.attribute(root / "sys/devices/system/node" / ("node" + std::to_string(n)) / "cpulist", tree.cpu_list());
  tree.attribute(root / "sys/devices/system/cpu/online", tree.cpu_list());
  tree.attribute(root / "proc/self/status", "Name:\ttessera\nCpus_allowed_list:\t" + tree.cpu_list() + "\n");
}

// A count as launchers write them, or one at the edges of int.
std::string fuzzed_count(FuzzedDataProvider& data) {
  static const char* const kCounts[] = {"0", "1", "2", "3", "8", "-1", "2147483647", "2147483648", " 4"};
  return data.PickValueInArray(kCounts);
}

// Slurm's task counts per node, "2(x3),1": parts of a count and a repeat.
std::string fuzzed_task_counts(FuzzedDataProvider& data) {
  std::string list;
  const int parts = data.ConsumeIntegralInRange<int>(1, 3);
  for (int p = 0; p < parts; ++p) {
    list += (p ? "," : "") + fuzzed_count(data);
    if (data.ConsumeBool()) list += "(x" + fuzzed_count(data) + ")";
  }
  return list;
}

// What srun gives a task: its node, local id and the task counts.
parallel::Environment slurm_environment(FuzzedDataProvider& data) {
  return {{"SLURM_LOCALID", fuzzed_count(data)},
          {"SLURM_NODEID", fuzzed_count(data)},
          {data.ConsumeBool() ? "SLURM_TASKS_PER_NODE" : "SLURM_STEP_TASKS_PER_NODE", fuzzed_task_counts(data)}};
}

parallel::Environment fuzzed_environment(FuzzedDataProvider& data) {
  static const char* const kNames[] = {"OMPI_COMM_WORLD_LOCAL_RANK",
                                       "OMPI_COMM_WORLD_LOCAL_SIZE",
                                       "SLURM_LOCALID",
                                       "SLURM_NODEID",
                                       "SLURM_STEP_TASKS_PER_NODE",
                                       "SLURM_TASKS_PER_NODE",
                                       "MPI_LOCALRANKID",
                                       "MPI_LOCALNRANKS",
                                       "PMIX_LOCAL_RANK",
                                       "PMIX_LOCAL_SIZE",
                                       "NCCL_IB_HCA",
                                       "NCCL_SOCKET_IFNAME",
                                       "CUDA_VISIBLE_DEVICES",
                                       "UCX_NET_DEVICES",
                                       "NCCL_IB_GID_INDEX"};
  parallel::Environment environment;
  const int count = data.ConsumeIntegralInRange<int>(0, 6);
  for (int i = 0; i < count; ++i) {
    const char* name = data.PickValueInArray(kNames);
    switch (data.ConsumeIntegralInRange<int>(0, 2)) {
      case 0:
        environment[name] = fuzzed_count(data);
        break;
      case 1:
        environment[name] = fuzzed_task_counts(data);
        break;
      default:
        environment[name] = data.ConsumeRandomLengthString(24);
        break;
    }
  }
  return environment;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider data(bytes, size);
  TreeBuilder tree(data, fresh_scratch_dir() / "node");
  fs::create_directories(tree.root());
  build_tree(data, tree);
  const parallel::Environment environment = data.ConsumeBool() ? fuzzed_environment(data) : slurm_environment(data);
  parallel::DiscoveryOptions options;
  options.use_nvml = false;
  if (data.ConsumeIntegralInRange<int>(0, 3) == 3)  // as if NVML listed these GPUs
    options.gpu_addresses =
        std::vector<std::string>{"00000000:" + TreeBuilder::hex2(0x40) + ":00.0", data.ConsumeRandomLengthString(16)};

  expect_clean_errors([&] {
    const parallel::Topology topology = parallel::discover_topology(tree.root().string(), options);
    int local_size = data.ConsumeIntegralInRange<int>(1, 9);
    expect_clean_errors([&] {
      (void)parallel::local_rank_from_environment(environment);
      if (const auto size_given = parallel::local_size_from_environment(environment))
        local_size = std::min(std::max(*size_given, 1), 64);  // a huge count is legal but would only slow the run
    });
    for (int rank = 0; rank < local_size; ++rank) {
      const parallel::TopologyDecision decision = parallel::decide_topology(topology, {rank, local_size}, environment);
      (void)parallel::format_topology_table(topology, decision);
      (void)parallel::format_decision_env(topology, decision);
      (void)parallel::summarize_decision(topology, decision);
    }
  });
  return 0;
}
