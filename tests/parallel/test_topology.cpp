// Topology discovery and the per-rank decision on the fixture trees of
// tests/fixtures/topology (written by make-fixtures.sh, modelled on real
// servers): what is found (GPUs, HCAs, ports, GIDs, interfaces, NUMA nodes,
// PCIe paths) and what each local rank is told (GPU, NCCL_IB_HCA, GID index,
// GPUDirect level, TCP fallback, UCX/Open MPI, CPUs), variables exported by
// the user winning, the launcher variables, CPU lists, errors, and discovery
// on this machine's own /sys.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "parallel/topology.h"

namespace tessera::parallel {
namespace {

namespace fs = std::filesystem;

std::string fixture(const std::string& name) {
  return (fs::path(TESSERA_TOPOLOGY_FIXTURES) / name).string();
}

// Fixtures only: NVML, if this machine had it, must not decide their GPUs.
DiscoveryOptions without_nvml() {
  DiscoveryOptions options;
  options.use_nvml = false;
  return options;
}

const Topology& dgx8() {
  static const Topology topology = discover_topology(fixture("dgx8"), without_nvml());
  return topology;
}

TopologyDecision decide(const Topology& topology, int rank, int size, const Environment& environment = {}) {
  return decide_topology(topology, {rank, size}, environment);
}

std::vector<int> range(int first, int last) {
  std::vector<int> values;
  for (int i = first; i <= last; ++i) values.push_back(i);
  return values;
}

const RdmaDevice& device_named(const Topology& topology, const std::string& name) {
  for (const RdmaDevice& device : topology.rdma_devices)
    if (device.name == name) return device;
  throw std::runtime_error("no RDMA device " + name);
}

TEST(TopologyDiscovery, Dgx8GpusHcasNumaAndPaths) {
  const Topology& t = dgx8();
  EXPECT_EQ(t.gpu_source, "sysfs");
  ASSERT_EQ(t.gpus.size(), 8u);
  EXPECT_EQ(t.gpus[0].pci.address, "0000:15:00.0");
  EXPECT_EQ(t.gpus[0].device_id, "0x20b2");
  EXPECT_EQ(t.gpus[0].pci.path, (std::vector<std::string>{"pci0000:10", "0000:10:01.1", "0000:11:00.0", "0000:12:00.0",
                                                          "0000:13:00.0", "0000:14:00.0", "0000:15:00.0"}));
  EXPECT_EQ(t.gpus[3].pci.numa_node, 0);
  EXPECT_EQ(t.gpus[4].pci.numa_node, 1);
  EXPECT_EQ(t.gpus[7].pci.address, "0000:b9:00.0");

  ASSERT_EQ(t.rdma_devices.size(), 8u);
  const RdmaDevice& mlx5_5 = device_named(t, "mlx5_5");
  EXPECT_EQ(mlx5_5.pci.address, "0000:9a:00.0");
  EXPECT_EQ(mlx5_5.netdevs, std::vector<std::string>{"ib5"});
  ASSERT_EQ(mlx5_5.ports.size(), 1u);
  EXPECT_EQ(mlx5_5.ports[0].state, "ACTIVE");
  EXPECT_EQ(mlx5_5.ports[0].link_layer, "InfiniBand");
  EXPECT_DOUBLE_EQ(mlx5_5.ports[0].gbps, 200);
  EXPECT_EQ(mlx5_5.ports[0].roce_v2_gid_index, -1);

  ASSERT_EQ(t.numa_nodes.size(), 2u);
  std::vector<int> node0 = range(0, 31), more = range(64, 95);
  node0.insert(node0.end(), more.begin(), more.end());
  EXPECT_EQ(t.numa_nodes[0].cpus, node0);
  EXPECT_TRUE(t.allowed_cpus.empty());  // no proc/self/status in the fixture: every CPU

  bool saw_eno1 = false, saw_ib3 = false;
  for (const NetInterface& net : t.interfaces) {
    if (net.name == "eno1") {
      saw_eno1 = true;
      EXPECT_TRUE(net.up && net.on_device && net.default_route);
      EXPECT_EQ(net.rdma_device, "");
    }
    if (net.name == "ib3") {
      saw_ib3 = true;
      EXPECT_EQ(net.type, 32);
      EXPECT_EQ(net.rdma_device, "mlx5_3");
    }
    if (net.name == "lo") {
      EXPECT_FALSE(net.on_device);
    }
  }
  EXPECT_TRUE(saw_eno1 && saw_ib3);
}

TEST(TopologyDiscovery, PcieRelationsOnDgx8) {
  const Topology& t = dgx8();
  const int numa = int(t.numa_nodes.size());
  const PciLocation& gpu0 = t.gpus[0].pci;
  EXPECT_EQ(pcie_relation(gpu0, device_named(t, "mlx5_0").pci, numa), PcieRelation::same_switch);
  EXPECT_EQ(pcie_relation(gpu0, device_named(t, "mlx5_1").pci, numa), PcieRelation::switch_hierarchy);
  EXPECT_EQ(pcie_relation(gpu0, device_named(t, "mlx5_2").pci, numa), PcieRelation::numa_node);
  EXPECT_EQ(pcie_relation(gpu0, device_named(t, "mlx5_4").pci, numa), PcieRelation::system);
  EXPECT_STREQ(nccl_level(PcieRelation::same_switch), "PIX");
  EXPECT_STREQ(nccl_level(PcieRelation::switch_hierarchy), "PXB");
  EXPECT_STREQ(nccl_level(PcieRelation::root_complex), "PHB");
  EXPECT_STREQ(nccl_level(PcieRelation::numa_node), "PHB");
  EXPECT_STREQ(nccl_level(PcieRelation::system), "SYS");
}

TEST(TopologyDiscovery, PcieRelationRules) {
  const PciLocation function0{"0000:43:00.0", {"pci0000:40", "0000:40:05.1", "0000:43:00.0"}, 0};
  const PciLocation function1{"0000:43:00.1", {"pci0000:40", "0000:40:05.1", "0000:43:00.1"}, 0};
  const PciLocation other_port{"0000:41:00.0", {"pci0000:40", "0000:40:01.1", "0000:41:00.0"}, 0};
  const PciLocation unknown_numa{"0000:81:00.0", {"pci0000:80", "0000:80:01.0", "0000:81:00.0"}, -1};
  EXPECT_EQ(pcie_relation(function0, function1, 2), PcieRelation::same_switch);  // one device's functions
  EXPECT_EQ(pcie_relation(function0, other_port, 2), PcieRelation::root_complex);
  EXPECT_EQ(pcie_relation(function0, unknown_numa, 1), PcieRelation::numa_node);  // one NUMA node: that one
  EXPECT_EQ(pcie_relation(function0, unknown_numa, 2), PcieRelation::system);     // unknown: assume the worst
}

TEST(TopologyDecision, Dgx8EachRankTakesTheHcaOnItsSwitch) {
  const Topology& t = dgx8();
  for (int rank = 0; rank < 8; ++rank) {
    SCOPED_TRACE("local rank " + std::to_string(rank));
    const TopologyDecision d = decide(t, rank, 8);
    const std::string hca = "mlx5_" + std::to_string(rank) + ":1";
    ASSERT_EQ(d.gpu, rank);
    ASSERT_EQ(d.rdma.size(), 1u);
    EXPECT_EQ(d.rdma[0].relation, PcieRelation::same_switch);
    EXPECT_EQ(d.transport, "InfiniBand");
    EXPECT_EQ(d.value("CUDA_DEVICE_ORDER"), "PCI_BUS_ID");
    EXPECT_EQ(d.value("CUDA_VISIBLE_DEVICES"), std::to_string(rank));
    EXPECT_EQ(d.value("NCCL_IB_HCA"), "=" + hca);
    EXPECT_EQ(d.value("NCCL_NET_GDR_LEVEL"), "PIX");
    EXPECT_EQ(d.value("NCCL_SOCKET_IFNAME"), "=eno1");  // the default route, the same for every rank
    EXPECT_EQ(d.value("UCX_NET_DEVICES"), hca);
    EXPECT_EQ(d.value("OMPI_MCA_pml"), "ucx");
    EXPECT_EQ(d.find("NCCL_IB_DISABLE"), nullptr);
    EXPECT_EQ(d.find("NCCL_IB_GID_INDEX"), nullptr);  // InfiniBand needs none
    EXPECT_EQ(d.numa_nodes, std::vector<int>{rank < 4 ? 0 : 1});
    EXPECT_EQ(d.value("TESSERA_CPU_BIND"), rank < 4 ? "0-31,64-95" : "32-63,96-127");
    EXPECT_TRUE(d.notes.empty()) << d.notes.front();
  }
}

TEST(TopologyDecision, MoreRanksThanGpusShareThem) {
  const TopologyDecision d = decide(dgx8(), 9, 16);
  EXPECT_EQ(d.gpu, 1);
  EXPECT_EQ(d.value("NCCL_IB_HCA"), "=mlx5_1:1");
  ASSERT_FALSE(d.notes.empty());
  EXPECT_NE(d.notes.front().find("16 local ranks share 8 GPUs"), std::string::npos);
}

TEST(TopologyDecision, InactiveNearestPortFallsBackToTheNextNearest) {
  Topology t = dgx8();
  for (RdmaDevice& device : t.rdma_devices)
    if (device.name == "mlx5_0") device.ports[0].state = "DOWN";
  const TopologyDecision d = decide(t, 0, 8);
  // GPU 0's own HCA is down; mlx5_1 is under the same upper switch (PXB).
  EXPECT_EQ(d.value("NCCL_IB_HCA"), "=mlx5_1:1");
  EXPECT_EQ(d.value("NCCL_NET_GDR_LEVEL"), "PXB");
  bool noted = false;
  for (const std::string& note : d.notes) noted |= note == "mlx5_0:1 is DOWN, not used";
  EXPECT_TRUE(noted);
}

TEST(TopologyDecision, NoActivePortMeansTcp) {
  Topology t = dgx8();
  for (RdmaDevice& device : t.rdma_devices) device.ports[0].state = "INIT";
  const TopologyDecision d = decide(t, 3, 8);
  EXPECT_EQ(d.transport, "TCP");
  EXPECT_TRUE(d.rdma.empty());
  EXPECT_EQ(d.value("NCCL_IB_DISABLE"), "1");
  EXPECT_EQ(d.find("NCCL_IB_HCA"), nullptr);
  EXPECT_EQ(d.find("NCCL_NET_GDR_LEVEL"), nullptr);
  EXPECT_EQ(d.find("UCX_NET_DEVICES"), nullptr);
  EXPECT_EQ(d.value("OMPI_MCA_pml"), "ob1");
  EXPECT_EQ(d.value("OMPI_MCA_btl"), "self,vader,tcp");
  EXPECT_EQ(d.value("OMPI_MCA_btl_tcp_if_include"), "eno1");
}

TEST(TopologyDecision, Roce2PortsSplitBetweenGpusWithTheirGidIndices) {
  const Topology t = discover_topology(fixture("roce2"), without_nvml());
  ASSERT_EQ(t.gpus.size(), 2u);
  ASSERT_EQ(t.rdma_devices.size(), 2u);
  EXPECT_EQ(t.rdma_devices[0].ports[0].link_layer, "Ethernet");
  EXPECT_EQ(t.rdma_devices[0].ports[0].roce_v2_gid_index, 3);  // IPv4-mapped RoCE v2, not link-local 1
  EXPECT_EQ(t.rdma_devices[1].ports[0].roce_v2_gid_index, 5);  // after the global IPv6 ones
  EXPECT_EQ(t.rdma_devices[1].netdevs, std::vector<std::string>{"ens5f1np1"});
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("local rank " + std::to_string(rank));
    const TopologyDecision d = decide(t, rank, 2);
    ASSERT_EQ(d.rdma.size(), 1u);
    EXPECT_EQ(d.rdma[0].relation, PcieRelation::root_complex);
    EXPECT_EQ(d.transport, "RoCE");
    EXPECT_EQ(d.value("NCCL_IB_HCA"), rank == 0 ? "=mlx5_0:1" : "=mlx5_1:1");
    EXPECT_EQ(d.value("NCCL_IB_GID_INDEX"), rank == 0 ? "3" : "5");
    EXPECT_EQ(d.value("NCCL_NET_GDR_LEVEL"), "LOC");  // through the host bridge: no GPUDirect RDMA
    EXPECT_EQ(d.value("NCCL_SOCKET_IFNAME"), "=ens5f0np0");
    EXPECT_EQ(d.value("TESSERA_CPU_BIND"), "0-31");
  }
}

TEST(TopologyDecision, NvmlListRestrictsGpusAndOneGpuTakesBothPortsOfOneGid) {
  // As in a container that NVML says holds only the second GPU (NVML's
  // eight-digit domain spelling).
  const Topology t =
      discover_topology(fixture("roce2"), {.gpu_addresses = std::vector<std::string>{"00000000:42:00.0"}});
  EXPECT_EQ(t.gpu_source, "NVML");
  ASSERT_EQ(t.gpus.size(), 1u);
  EXPECT_EQ(t.gpus[0].pci.address, "0000:42:00.0");
  EXPECT_EQ(t.gpus[0].index, 0);
  const TopologyDecision d = decide(t, 0, 1);
  EXPECT_EQ(d.value("CUDA_VISIBLE_DEVICES"), "0");
  // Both ports are equally near, but their GID indices differ and
  // NCCL_IB_GID_INDEX is one number: the second is left out, with a note.
  EXPECT_EQ(d.value("NCCL_IB_HCA"), "=mlx5_0:1");
  EXPECT_EQ(d.value("NCCL_IB_GID_INDEX"), "3");
  bool noted = false;
  for (const std::string& note : d.notes) noted |= note.find("mlx5_1:1 left out") != std::string::npos;
  EXPECT_TRUE(noted);

  const Topology mismatch =
      discover_topology(fixture("roce2"), {.gpu_addresses = std::vector<std::string>{"0000:99:00.0"}});
  EXPECT_EQ(mismatch.gpu_source, "sysfs");
  EXPECT_EQ(mismatch.gpus.size(), 2u);
  ASSERT_EQ(mismatch.notes.size(), 1u);
  EXPECT_NE(mismatch.notes[0].find("0000:99:00.0"), std::string::npos);
}

TEST(TopologyDecision, TcpOnlyNode) {
  const Topology t = discover_topology(fixture("tcp-only"), without_nvml());
  EXPECT_TRUE(t.rdma_devices.empty());
  ASSERT_EQ(t.gpus.size(), 4u);
  const TopologyDecision d = decide(t, 2, 4);
  EXPECT_EQ(d.gpu, 2);
  EXPECT_EQ(d.transport, "TCP");
  EXPECT_EQ(d.value("NCCL_IB_DISABLE"), "1");
  EXPECT_EQ(d.value("NCCL_SOCKET_IFNAME"), "=eth0");  // not docker0 (virtual), not lo
  EXPECT_EQ(d.find("NCCL_NET_GDR_LEVEL"), nullptr);
  EXPECT_EQ(d.find("UCX_NET_DEVICES"), nullptr);
  EXPECT_EQ(d.value("OMPI_MCA_pml"), "ob1");
  EXPECT_EQ(d.value("OMPI_MCA_btl_tcp_if_include"), "eth0");
  EXPECT_EQ(d.value("TESSERA_CPU_BIND"), "16-31");  // GPU 2 is on NUMA node 1
}

TEST(TopologyDecision, CpuOnlyNodeSpreadsRanksOverNumaNodes) {
  const Topology t = discover_topology(fixture("cpu-only"), without_nvml());
  EXPECT_TRUE(t.gpus.empty()) << "the ASPEED VGA controller is not a GPU";
  const std::vector<std::string> expected{"0-7,16-23", "0-7,16-23", "8-15,24-31", "8-15,24-31"};
  for (int rank = 0; rank < 4; ++rank) {
    const TopologyDecision d = decide(t, rank, 4);
    EXPECT_FALSE(d.gpu.has_value());
    EXPECT_EQ(d.value("TESSERA_CPU_BIND"), expected[rank]) << "local rank " << rank;
    EXPECT_EQ(d.value("OMPI_MCA_pml"), "ob1");
    for (const Setting& setting : d.settings)
      EXPECT_NE(setting.name.rfind("NCCL_", 0), 0u) << setting.name << " set on a node without GPUs";
    EXPECT_EQ(d.find("CUDA_VISIBLE_DEVICES"), nullptr);
  }
  // One rank: both NUMA nodes.
  EXPECT_EQ(decide(t, 0, 1).value("TESSERA_CPU_BIND"), "0-31");
}

TEST(TopologyDecision, DownPortIsSkippedAndNoted) {
  const Topology t = discover_topology(fixture("down-port"), without_nvml());
  ASSERT_EQ(t.rdma_devices.size(), 2u);
  EXPECT_EQ(t.rdma_devices[1].ports[0].state, "DOWN");
  const TopologyDecision rank0 = decide(t, 0, 2);
  EXPECT_EQ(rank0.value("NCCL_IB_HCA"), "=mlx5_0:1");
  EXPECT_EQ(rank0.value("NCCL_NET_GDR_LEVEL"), "PIX");
  // GPU 1's own HCA is down: it uses mlx5_0 on the other root complex of its
  // NUMA node, without GPUDirect RDMA.
  const TopologyDecision rank1 = decide(t, 1, 2);
  ASSERT_EQ(rank1.rdma.size(), 1u);
  EXPECT_EQ(rank1.rdma[0].device, "mlx5_0");
  EXPECT_EQ(rank1.rdma[0].relation, PcieRelation::numa_node);
  EXPECT_EQ(rank1.value("NCCL_NET_GDR_LEVEL"), "LOC");
  EXPECT_EQ(rank1.find("NCCL_IB_DISABLE"), nullptr);
  ASSERT_FALSE(rank1.notes.empty());
  EXPECT_EQ(rank1.notes.front(), "mlx5_1:1 is DOWN, not used");
}

TEST(TopologyDecision, ExportedVariablesWin) {
  const Environment environment{
      {"NCCL_IB_HCA", "=mlx5_3:1"}, {"CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7"}, {"OMPI_MCA_pml", "ucx"}};
  const TopologyDecision d = decide(dgx8(), 1, 8, environment);
  const Setting* hca = d.find("NCCL_IB_HCA");
  ASSERT_NE(hca, nullptr);
  EXPECT_TRUE(hca->kept);
  EXPECT_EQ(hca->value, "=mlx5_3:1");
  EXPECT_EQ(hca->computed, "=mlx5_1:1");
  EXPECT_TRUE(d.find("CUDA_VISIBLE_DEVICES")->kept);
  EXPECT_TRUE(d.find("OMPI_MCA_pml")->kept);
  EXPECT_FALSE(d.find("NCCL_NET_GDR_LEVEL")->kept);
  // A kept value that differs is noted; one equal to the computed one is not.
  ASSERT_EQ(d.notes.size(), 2u);
  EXPECT_EQ(d.notes[0], "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 kept from the environment (computed: 1)");
  EXPECT_EQ(d.notes[1], "NCCL_IB_HCA==mlx5_3:1 kept from the environment (computed: =mlx5_1:1)");

  const std::string env = format_decision_env(dgx8(), d);
  EXPECT_NE(env.find("# kept from the environment: NCCL_IB_HCA==mlx5_3:1 (computed: =mlx5_1:1)\n"), std::string::npos)
      << env;
  EXPECT_EQ(env.find("export NCCL_IB_HCA="), std::string::npos) << env;
  EXPECT_NE(env.find("export NCCL_NET_GDR_LEVEL='PIX'\n"), std::string::npos) << env;
}

TEST(TopologyDecision, AllowedCpusLimitTheBinding) {
  Topology t = discover_topology(fixture("cpu-only"), without_nvml());
  t.allowed_cpus = range(4, 11);  // e.g. a cgroup cpuset or Slurm's binding
  EXPECT_EQ(decide(t, 0, 2).value("TESSERA_CPU_BIND"), "4-7");
  EXPECT_EQ(decide(t, 1, 2).value("TESSERA_CPU_BIND"), "8-11");
  t.allowed_cpus = range(0, 3);
  const TopologyDecision outside = decide(t, 1, 2);
  EXPECT_EQ(outside.find("TESSERA_CPU_BIND"), nullptr);
  ASSERT_FALSE(outside.notes.empty());
  EXPECT_NE(outside.notes.back().find("outside this process's allowed CPUs (0-3)"), std::string::npos);
}

TEST(TopologyDecision, EmptyTopologyStillDecides) {
  // Nothing found at all (a container with no sysfs to speak of): MPI over
  // TCP, no interface named, no binding.
  const TopologyDecision d = decide(Topology{}, 0, 1);
  EXPECT_EQ(d.transport, "TCP");
  EXPECT_EQ(d.value("OMPI_MCA_pml"), "ob1");
  EXPECT_EQ(d.find("OMPI_MCA_btl_tcp_if_include"), nullptr);
  EXPECT_EQ(d.find("TESSERA_CPU_BIND"), nullptr);
  EXPECT_TRUE(d.cpus.empty());
}

TEST(TopologyDecision, ImpossiblePlacementThrows) {
  try {
    decide(dgx8(), 8, 8);
    FAIL() << "no error for local rank 8 of 8";
  } catch (const Error& error) {
    EXPECT_NE(error.message().find("local rank 8 of 8 is impossible"), std::string::npos) << error.message();
  }
  EXPECT_THROW(decide(dgx8(), 0, 0), Error);
}

TEST(TopologyDiscovery, MissingRootThrowsNamingIt) {
  try {
    discover_topology("/nonexistent/sysfs-root");
    FAIL() << "no error for a missing root";
  } catch (const Error& error) {
    EXPECT_NE(error.message().find("'/nonexistent/sysfs-root' is not a directory"), std::string::npos);
    EXPECT_NE(error.message().find("--sysfs-root"), std::string::npos);
  }
}

TEST(TopologyDiscovery, ThisMachine) {
  // The real /sys and /proc: whatever this machine has, discovery works, it
  // has at least one NUMA node with CPUs, and the decision binds within the
  // CPUs this process may use.
  const Topology t = discover_topology("/");
  ASSERT_FALSE(t.numa_nodes.empty());
  EXPECT_FALSE(t.numa_nodes[0].cpus.empty());
  const TopologyDecision d = decide(t, 0, 1);
  EXPECT_FALSE(d.value("OMPI_MCA_pml").empty());
  for (int cpu : d.cpus) {
    if (!t.allowed_cpus.empty()) {
      EXPECT_TRUE(std::find(t.allowed_cpus.begin(), t.allowed_cpus.end(), cpu) != t.allowed_cpus.end()) << cpu;
    }
  }
  const std::string summary = describe_topology_decision(0, 1);
  EXPECT_EQ(summary.rfind("topology: local rank 0 of 1: ", 0), 0u) << summary;
}

TEST(TopologyEnvironment, LauncherVariables) {
  EXPECT_EQ(local_rank_from_environment({}), std::nullopt);
  EXPECT_EQ(local_size_from_environment({}), std::nullopt);
  const Environment mpirun{{"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"},
                           {"SLURM_LOCALID", "0"},
                           {"SLURM_TASKS_PER_NODE", "1"}};
  EXPECT_EQ(local_rank_from_environment(mpirun), 3);  // mpirun inside a Slurm job: mpirun's numbers
  EXPECT_EQ(local_size_from_environment(mpirun), 8);
  const Environment srun{{"SLURM_LOCALID", "1"},
                         {"SLURM_NODEID", "2"},
                         {"SLURM_STEP_TASKS_PER_NODE", "4(x2),2"},
                         {"SLURM_TASKS_PER_NODE", "8(x3)"}};
  EXPECT_EQ(local_rank_from_environment(srun), 1);
  EXPECT_EQ(local_size_from_environment(srun), 2);  // the step's list wins over the job's
  EXPECT_EQ(
      local_size_from_environment({{"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "1"}, {"SLURM_TASKS_PER_NODE", "8(x3)"}}),
      8);
  EXPECT_EQ(local_rank_from_environment({{"MPI_LOCALRANKID", "2"}, {"MPI_LOCALNRANKS", "4"}}), 2);
  EXPECT_EQ(local_size_from_environment({{"PMIX_LOCAL_RANK", "0"}, {"PMIX_LOCAL_SIZE", "2"}}), 2);
  EXPECT_THROW(local_rank_from_environment({{"SLURM_LOCALID", "one"}}), Error);
  EXPECT_THROW(local_size_from_environment({{"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "2(x3"}}), Error);
  // A huge repeat count (found by fuzzing: the node index overflowed) is still read right.
  EXPECT_EQ(local_size_from_environment(
                {{"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "5"}, {"SLURM_TASKS_PER_NODE", "3(x2147483647),1"}}),
            3);
  EXPECT_EQ(local_size_from_environment(
                {{"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "2"}, {"SLURM_TASKS_PER_NODE", "1(x2),2(x2147483647)"}}),
            2);
}

TEST(TopologyCpuList, ParseAndFormat) {
  EXPECT_EQ(parse_cpu_list("0-3,8,10-11", "test"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(parse_cpu_list("", "test"), std::vector<int>{});
  EXPECT_EQ(format_cpu_list({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(format_cpu_list({}), "");
  EXPECT_EQ(format_cpu_list(parse_cpu_list("32-63,96-127", "test")), "32-63,96-127");
  try {
    parse_cpu_list("3-1", "node0/cpulist");
    FAIL() << "no error for 3-1";
  } catch (const Error& error) {
    EXPECT_NE(error.message().find("node0/cpulist: '3-1' is not a CPU list"), std::string::npos);
  }
  // A range no machine has (found by fuzzing: it looped past INT_MAX, allocating without bound) is refused.
  try {
    parse_cpu_list("0-2147483647", "node0/cpulist");
    FAIL() << "no error for 0-2147483647";
  } catch (const Error& error) {
    EXPECT_NE(error.message().find("names CPU 2147483647; CPU numbers must be below 65536"), std::string::npos);
  }
}

}  // namespace
}  // namespace tessera::parallel
