// Topology discovery from sysfs/procfs (and NVML when it is there:
// parallel/nvml.h), the per-rank decision, and its text forms. See topology.h
// for what is read and why; the rules of the decision are written beside
// decide_topology().
#include "parallel/topology.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "core/error.h"
#include "parallel/nvml.h"

extern char** environ;

namespace tessera::parallel {
namespace {

namespace fs = std::filesystem;

std::string trim(std::string text) {
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  const auto last = text.find_last_not_of(" \t\r\n");
  return text.substr(first, last - first + 1);
}

// A sysfs attribute's text, trimmed; nothing when it is absent or unreadable
// (the kernel answers EINVAL for unused GID table entries, for instance).
std::optional<std::string> read_attribute(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return std::nullopt;
  return trim(text.str());
}

std::vector<fs::path> entries(const fs::path& directory) {
  std::vector<fs::path> found;
  std::error_code error;
  for (fs::directory_iterator it(directory, error), end; !error && it != end; it.increment(error))
    found.push_back(it->path());
  std::sort(found.begin(), found.end());
  return found;
}

std::optional<int> parse_int(std::string_view text) {
  int value = 0;
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
  if (result.ec != std::errc() || result.ptr != text.data() + text.size()) return std::nullopt;
  return value;
}

// The PCIe path of the device a sysfs link (or directory) leads to: the
// components of its canonical path below <root>/sys/devices.
PciLocation pci_location(const fs::path& link, const fs::path& devices_root) {
  PciLocation location;
  std::error_code error;
  const fs::path target = fs::canonical(link, error);
  if (error) return location;
  location.address = target.filename().string();
  const fs::path relative = target.lexically_relative(devices_root);
  if (!relative.empty() && *relative.begin() != "..") {
    for (const fs::path& part : relative) location.path.push_back(part.string());
  } else {
    location.path.push_back(location.address);
  }
  if (const auto numa = read_attribute(target / "numa_node")) location.numa_node = parse_int(*numa).value_or(-1);
  return location;
}

// NVML prints "00000000:15:00.0"; sysfs names the same function "0000:15:00.0".
std::string normalize_pci_address(std::string address) {
  std::transform(address.begin(), address.end(), address.begin(), [](unsigned char c) { return std::tolower(c); });
  const auto colon = address.find(':');
  if (colon != std::string::npos && colon > 4) address.erase(0, colon - 4);
  return address;
}

// "4: ACTIVE" -> "ACTIVE".
std::string after_colon(const std::string& text) {
  const auto colon = text.find(':');
  return colon == std::string::npos ? text : trim(text.substr(colon + 1));
}

// The GID index NCCL should use on a RoCE port: a RoCE v2 entry, preferring
// an IPv4-mapped GID (routable, what NCCL's documentation recommends), then a
// global IPv6 one, then link-local; the lowest index within a kind.
int roce_v2_gid_index(const fs::path& port) {
  int best = -1, best_rank = 99;
  for (const fs::path& entry : entries(port / "gid_attrs" / "types")) {
    const auto index = parse_int(entry.filename().string());
    const auto type = read_attribute(entry);
    if (!index || !type || *type != "RoCE v2") continue;
    const auto gid = read_attribute(port / "gids" / entry.filename());
    if (!gid || gid->find_first_not_of("0:") == std::string::npos) continue;  // empty entry
    int rank = 2;
    if (gid->rfind("0000:0000:0000:0000:0000:ffff:", 0) == 0)
      rank = 0;
    else if (gid->rfind("fe80:", 0) != 0)
      rank = 1;
    if (rank < best_rank || (rank == best_rank && *index < best)) {
      best = *index;
      best_rank = rank;
    }
  }
  return best;
}

std::vector<RdmaDevice> discover_rdma(const fs::path& root, const fs::path& devices_root) {
  std::vector<RdmaDevice> devices;
  for (const fs::path& dir : entries(root / "sys/class/infiniband")) {
    RdmaDevice device;
    device.name = dir.filename().string();
    device.pci = pci_location(dir / "device", devices_root);
    for (const fs::path& net : entries(dir / "device" / "net")) device.netdevs.push_back(net.filename().string());
    for (const fs::path& port_dir : entries(dir / "ports")) {
      const auto number = parse_int(port_dir.filename().string());
      if (!number) continue;
      RdmaPort port;
      port.number = *number;
      port.state = after_colon(read_attribute(port_dir / "state").value_or("unknown"));
      port.link_layer = read_attribute(port_dir / "link_layer").value_or("InfiniBand");
      port.rate = read_attribute(port_dir / "rate").value_or("");
      port.gbps = std::atof(port.rate.c_str());
      if (port.roce()) port.roce_v2_gid_index = roce_v2_gid_index(port_dir);
      device.ports.push_back(port);
    }
    std::sort(device.ports.begin(), device.ports.end(),
              [](const RdmaPort& a, const RdmaPort& b) { return a.number < b.number; });
    devices.push_back(std::move(device));
  }
  return devices;
}

std::vector<NetInterface> discover_interfaces(const fs::path& root, const std::vector<RdmaDevice>& rdma) {
  // proc/net/route: "Iface Destination Gateway Flags RefCnt Use Metric Mask ..." in hex.
  std::set<std::string> routed, default_routed;
  if (std::ifstream routes(root / "proc/net/route"); routes) {
    std::string line;
    std::getline(routes, line);  // the header
    while (std::getline(routes, line)) {
      std::istringstream fields(line);
      std::string name, destination, gateway, flags, refcnt, use, metric, mask;
      if (!(fields >> name >> destination >> gateway >> flags >> refcnt >> use >> metric >> mask)) continue;
      routed.insert(name);
      if (destination == "00000000" && mask == "00000000") default_routed.insert(name);
    }
  }
  std::vector<NetInterface> interfaces;
  for (const fs::path& dir : entries(root / "sys/class/net")) {
    NetInterface net;
    net.name = dir.filename().string();
    net.operstate = read_attribute(dir / "operstate").value_or("unknown");
    net.up = net.operstate == "up";
    std::error_code error;
    net.on_device = fs::exists(dir / "device", error);
    net.type = parse_int(read_attribute(dir / "type").value_or("0")).value_or(0);
    net.has_route = routed.count(net.name) > 0;
    net.default_route = default_routed.count(net.name) > 0;
    for (const RdmaDevice& device : rdma)
      if (std::find(device.netdevs.begin(), device.netdevs.end(), net.name) != device.netdevs.end())
        net.rdma_device = device.name;
    interfaces.push_back(std::move(net));
  }
  return interfaces;
}

std::vector<NumaNode> discover_numa(const fs::path& root) {
  std::vector<NumaNode> nodes;
  for (const fs::path& dir : entries(root / "sys/devices/system/node")) {
    const std::string name = dir.filename().string();
    if (name.rfind("node", 0) != 0) continue;
    const auto id = parse_int(std::string_view(name).substr(4));
    const auto cpulist = read_attribute(dir / "cpulist");
    if (!id || !cpulist) continue;
    NumaNode node{*id, parse_cpu_list(*cpulist, (dir / "cpulist").string())};
    if (!node.cpus.empty()) nodes.push_back(std::move(node));  // memory-only nodes hold no CPUs
  }
  std::sort(nodes.begin(), nodes.end(), [](const NumaNode& a, const NumaNode& b) { return a.id < b.id; });
  if (nodes.empty()) {
    const auto online = read_attribute(root / "sys/devices/system/cpu/online");
    nodes.push_back({0, online ? parse_cpu_list(*online, "sys/devices/system/cpu/online") : std::vector<int>{}});
  }
  return nodes;
}

std::vector<int> discover_allowed_cpus(const fs::path& root) {
  std::ifstream status(root / "proc/self/status");
  std::string line;
  const std::string key = "Cpus_allowed_list:";
  while (std::getline(status, line))
    if (line.rfind(key, 0) == 0) return parse_cpu_list(trim(line.substr(key.size())), "Cpus_allowed_list");
  return {};
}

std::vector<Gpu> discover_gpus(const fs::path& root, const fs::path& devices_root, const DiscoveryOptions& options,
                               Topology& topology) {
  std::vector<Gpu> gpus;
  for (const fs::path& link : entries(root / "sys/bus/pci/devices")) {
    const std::string pci_class = read_attribute(link / "class").value_or("");
    if (read_attribute(link / "vendor").value_or("") != "0x10de") continue;
    if (pci_class.rfind("0x0302", 0) != 0 && pci_class.rfind("0x0300", 0) != 0) continue;
    Gpu gpu;
    gpu.device_id = read_attribute(link / "device").value_or("");
    gpu.pci = pci_location(link, devices_root);
    gpus.push_back(std::move(gpu));
  }
  std::sort(gpus.begin(), gpus.end(), [](const Gpu& a, const Gpu& b) { return a.pci.address < b.pci.address; });

  std::optional<std::vector<std::string>> listed = options.gpu_addresses;
  std::error_code error;
  if (!listed && options.use_nvml && fs::equivalent(root, "/", error)) listed = nvml_gpu_addresses();
  if (listed) {
    std::vector<Gpu> visible;
    std::string missing;
    for (const std::string& given : *listed) {
      const std::string address = normalize_pci_address(given);
      const auto found = std::find_if(gpus.begin(), gpus.end(), [&](const Gpu& g) { return g.pci.address == address; });
      if (found == gpus.end())
        missing += (missing.empty() ? "" : ", ") + address;
      else
        visible.push_back(*found);
    }
    if (missing.empty()) {
      std::sort(visible.begin(), visible.end(),
                [](const Gpu& a, const Gpu& b) { return a.pci.address < b.pci.address; });
      gpus = std::move(visible);
      topology.gpu_source = "NVML";
    } else {
      topology.notes.push_back("NVML lists GPUs that sysfs does not show (" + missing + "); using sysfs's " +
                               std::to_string(gpus.size()) + " GPUs");
    }
  }
  for (size_t i = 0; i < gpus.size(); ++i) gpus[i].index = int(i);
  return gpus;
}

}  // namespace

const char* nccl_level(PcieRelation relation) {
  switch (relation) {
    case PcieRelation::same_switch:
      return "PIX";
    case PcieRelation::switch_hierarchy:
      return "PXB";
    case PcieRelation::root_complex:
    case PcieRelation::numa_node:
      return "PHB";
    case PcieRelation::system:
      return "SYS";
  }
  return "SYS";
}

const char* describe(PcieRelation relation) {
  switch (relation) {
    case PcieRelation::same_switch:
      return "same PCIe switch";
    case PcieRelation::switch_hierarchy:
      return "PCIe switches below one root port";
    case PcieRelation::root_complex:
      return "same root complex";
    case PcieRelation::numa_node:
      return "same NUMA node";
    case PcieRelation::system:
      return "across NUMA nodes";
  }
  return "unknown";
}

PcieRelation pcie_relation(const PciLocation& a, const PciLocation& b, int numa_nodes) {
  if (!a.path.empty() && !b.path.empty() && a.path.size() > 1 && b.path.size() > 1 && a.path[0] == b.path[0]) {
    // One root complex. Below the deepest common ancestor, count the bridges
    // on the longer side: one (a switch's downstream port, or none for two
    // functions of one device) is a single switch; more is a hierarchy.
    size_t common = 0;
    while (common < a.path.size() && common < b.path.size() && a.path[common] == b.path[common]) ++common;
    if (common == 1) return PcieRelation::root_complex;
    const size_t below = std::max(a.path.size(), b.path.size()) - common;
    return below <= 2 ? PcieRelation::same_switch : PcieRelation::switch_hierarchy;
  }
  if (a.numa_node >= 0 && b.numa_node >= 0)
    return a.numa_node == b.numa_node ? PcieRelation::numa_node : PcieRelation::system;
  return numa_nodes <= 1 ? PcieRelation::numa_node : PcieRelation::system;
}

std::string format_cpu_list(const std::vector<int>& cpus) {
  std::string text;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    text += (text.empty() ? "" : ",") + std::to_string(cpus[i]);
    if (j > i) text += "-" + std::to_string(cpus[j]);
    i = j + 1;
  }
  return text;
}

std::vector<int> parse_cpu_list(const std::string& text, const std::string& what) {
  std::vector<int> cpus;
  std::stringstream parts(text);
  std::string part;
  while (std::getline(parts, part, ',')) {
    part = trim(part);
    if (part.empty()) continue;
    const auto dash = part.find('-');
    const auto first = parse_int(std::string_view(part).substr(0, dash));
    const auto last = dash == std::string::npos ? first : parse_int(std::string_view(part).substr(dash + 1));
    TESSERA_CHECK(first && last && *first >= 0 && *last >= *first, "topology: ", what, ": '", text,
                  "' is not a CPU list like 0-3,8,10-11");
    // Linux numbers CPUs below CONFIG_NR_CPUS (at most 8192 today): anything
    // far beyond is a damaged file, not a machine.
    constexpr int kMaxCpu = 1 << 16;
    TESSERA_CHECK(*last < kMaxCpu, "topology: ", what, ": '", text, "' names CPU ", *last,
                  "; CPU numbers must be below ", kMaxCpu);
    for (int cpu = *first; cpu <= *last; ++cpu) cpus.push_back(cpu);
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

std::optional<std::vector<std::string>> nvml_gpu_addresses() {
  const std::optional<std::vector<std::string>> ids = Nvml().gpu_bus_ids();
  if (!ids) return std::nullopt;
  std::vector<std::string> addresses;
  for (const std::string& id : *ids) addresses.push_back(normalize_pci_address(id));
  return addresses;
}

Topology discover_topology(const std::string& root, const DiscoveryOptions& options) {
  std::error_code error;
  TESSERA_CHECK(fs::is_directory(root, error), "topology: the sysfs root '", root,
                "' is not a directory; give --sysfs-root the directory that holds sys/ (and proc/), or / on a node");
  Topology topology;
  topology.root = root;
  const fs::path base = fs::canonical(root);
  const fs::path devices_root = fs::weakly_canonical(base / "sys/devices");
  topology.gpus = discover_gpus(base, devices_root, options, topology);
  topology.rdma_devices = discover_rdma(base, devices_root);
  topology.interfaces = discover_interfaces(base, topology.rdma_devices);
  topology.numa_nodes = discover_numa(base);
  topology.allowed_cpus = discover_allowed_cpus(base);
  return topology;
}

Environment process_environment() {
  Environment environment;
  for (char** entry = environ; entry && *entry; ++entry) {
    const std::string text = *entry;
    const auto equals = text.find('=');
    if (equals != std::string::npos) environment[text.substr(0, equals)] = text.substr(equals + 1);
  }
  return environment;
}

namespace {

std::optional<std::string> lookup(const Environment& environment, const std::string& name) {
  const auto found = environment.find(name);
  if (found == environment.end() || found->second.empty()) return std::nullopt;
  return found->second;
}

int parse_count(const std::string& value, const std::string& name) {
  const auto parsed = parse_int(trim(value));
  TESSERA_CHECK(parsed && *parsed >= 0, "topology: ", name, "='", value,
                "' is not a non-negative integer; unset it or fix the launcher");
  return *parsed;
}

// Slurm's per-node task counts, "2(x3),1": node i's count.
std::optional<int> slurm_tasks_on_node(const std::string& text, int node, const std::string& name) {
  std::stringstream parts(text);
  std::string part;
  int first_node = 0;
  while (std::getline(parts, part, ',')) {
    int repeat = 1;
    const auto paren = part.find("(x");
    if (paren != std::string::npos) {
      TESSERA_CHECK(part.back() == ')', "topology: ", name, "='", text, "' is not like 2(x3),1");
      repeat = parse_count(part.substr(paren + 2, part.size() - paren - 3), name);
      part = part.substr(0, paren);
    }
    const int tasks = parse_count(part, name);
    if (int64_t(node) < int64_t(first_node) + repeat) return tasks;  // no int overflow for huge repeats
    first_node += repeat;
  }
  return std::nullopt;
}

// (local rank variable, local size variable) per launcher, the first present wins.
struct LauncherVariables {
  const char* rank;
  const char* size;
};
constexpr LauncherVariables kLaunchers[] = {
    {"OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"SLURM_LOCALID", nullptr},  // the size comes from the task-count lists
    {"PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"},
};

}  // namespace

std::optional<int> local_rank_from_environment(const Environment& environment) {
  for (const LauncherVariables& launcher : kLaunchers)
    if (const auto value = lookup(environment, launcher.rank)) return parse_count(*value, launcher.rank);
  return std::nullopt;
}

std::optional<int> local_size_from_environment(const Environment& environment) {
  for (const LauncherVariables& launcher : kLaunchers) {
    if (!lookup(environment, launcher.rank)) continue;
    if (launcher.size) {
      const auto value = lookup(environment, launcher.size);
      return value ? std::optional<int>(parse_count(*value, launcher.size)) : std::nullopt;
    }
    const int node = parse_count(lookup(environment, "SLURM_NODEID").value_or("0"), "SLURM_NODEID");
    for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"})
      if (const auto value = lookup(environment, name)) return slurm_tasks_on_node(*value, node, name);
    return std::nullopt;
  }
  return std::nullopt;
}

const Setting* TopologyDecision::find(const std::string& name) const {
  for (const Setting& setting : settings)
    if (setting.name == name) return &setting;
  return nullptr;
}

std::string TopologyDecision::value(const std::string& name) const {
  const Setting* setting = find(name);
  return setting ? setting->value : "";
}

namespace {

struct PortRef {
  const RdmaDevice* device;
  const RdmaPort* port;
};

std::string port_name(const RdmaChoice& choice) {
  return choice.device + ":" + std::to_string(choice.port);
}

RdmaChoice make_choice(const PortRef& ref, std::optional<PcieRelation> relation) {
  return {ref.device->name, ref.port->number, ref.port->roce(), ref.port->gbps, relation};
}

// The ports nearest `gpu` among `active`, with their relation.
std::vector<std::pair<PortRef, PcieRelation>> nearest_ports(const Gpu& gpu, const std::vector<PortRef>& active,
                                                            int numa_nodes) {
  std::vector<std::pair<PortRef, PcieRelation>> nearest;
  for (const PortRef& ref : active) {
    const PcieRelation relation = pcie_relation(gpu.pci, ref.device->pci, numa_nodes);
    if (!nearest.empty() && relation > nearest.front().second) continue;
    if (!nearest.empty() && relation < nearest.front().second) nearest.clear();
    nearest.push_back({ref, relation});
  }
  return nearest;
}

std::string same_ports_key(const std::vector<std::pair<PortRef, PcieRelation>>& ports) {
  std::string key;
  for (const auto& [ref, relation] : ports) key += ref.device->name + ":" + std::to_string(ref.port->number) + ",";
  return key;
}

// The interface for TCP traffic and NCCL's bootstrap: up, on hardware, not
// loopback; the one with the default route first, then any with an IPv4
// route, then by name. The same for every rank of the node, so that
// bootstrap connections between ranks use one network.
std::string socket_interface(const Topology& topology) {
  const NetInterface* best = nullptr;
  auto score = [](const NetInterface& net) { return (net.default_route ? 2 : 0) + (net.has_route ? 1 : 0); };
  for (const NetInterface& net : topology.interfaces) {
    if (!net.up || !net.on_device || net.type == 772) continue;
    if (!best || score(net) > score(*best)) best = &net;
  }
  return best ? best->name : "";
}

void add_setting(TopologyDecision& decision, const Environment& environment, const std::string& name,
                 const std::string& value, const std::string& reason) {
  Setting setting{name, value, value, false, reason};
  if (const auto found = environment.find(name); found != environment.end()) {
    setting.kept = true;
    setting.value = found->second;
    if (found->second != value)
      decision.notes.push_back(name + "=" + found->second + " kept from the environment (computed: " + value + ")");
  }
  decision.settings.push_back(std::move(setting));
}

std::vector<int> intersect(const std::vector<int>& cpus, const std::vector<int>& allowed) {
  if (allowed.empty()) return cpus;
  std::vector<int> both;
  std::set_intersection(cpus.begin(), cpus.end(), allowed.begin(), allowed.end(), std::back_inserter(both));
  return both;
}

}  // namespace

// The rules:
// - GPU: local rank r takes GPU r mod G in PCI bus order (what the trainer's
//   --device cuda picks with CUDA_DEVICE_ORDER=PCI_BUS_ID); more ranks than
//   GPUs share them, with a note.
// - RDMA: the ACTIVE ports nearest the rank's GPU by PCIe relation. When
//   several are equally near, the GPUs that share that same set divide the
//   ports between them (GPU k of n takes ports k, k+n, ...; more GPUs than
//   ports share). On RoCE, ports whose RoCE v2 GID index differs from the
//   first's are left out: NCCL_IB_GID_INDEX is one number per process. CPU
//   ranks take a port on their own NUMA node when there is one.
// - GPUDirect RDMA (NCCL_NET_GDR_LEVEL) at the chosen port's level when the
//   path stays below the host bridge (PIX, PXB); through a host bridge or
//   between sockets the data is staged in host memory (LOC), as NCCL's own
//   default does.
// - No ACTIVE port: NCCL_IB_DISABLE=1, and Open MPI's ob1 PML over TCP.
// - CPUs: the GPU's NUMA node; on CPU-only nodes ranks are spread over the
//   NUMA nodes in blocks (fewer ranks than nodes: each rank takes several).
//   Always within the CPUs this process is allowed to use.
// Over 120 lines on purpose: one rule per paragraph, in the order of the list
// above, each reading what the earlier ones chose (GPU, then port, then GDR,
// then CPUs); it is a pure function, tested rule by rule on fixture trees.
TopologyDecision decide_topology(const Topology& topology, RankPlacement placement, const Environment& environment) {
  TESSERA_CHECK(placement.local_size >= 1 && placement.local_rank >= 0 && placement.local_rank < placement.local_size,
                "topology: local rank ", placement.local_rank, " of ", placement.local_size,
                " is impossible; the local rank must be in [0, local size) (check --local-rank and --local-size, "
                "or the launcher's OMPI_COMM_WORLD_LOCAL_RANK/SLURM_LOCALID)");
  TopologyDecision decision;
  decision.placement = placement;
  const int rank = placement.local_rank;
  const int numa_count = int(topology.numa_nodes.size());

  std::vector<PortRef> active;
  for (const RdmaDevice& device : topology.rdma_devices) {
    for (const RdmaPort& port : device.ports) {
      if (port.active())
        active.push_back({&device, &port});
      else
        decision.notes.push_back(device.name + ":" + std::to_string(port.number) + " is " + port.state + ", not used");
    }
  }

  // The GPU and the NUMA nodes the rank's CPUs come from.
  std::vector<int> numa_ids;
  if (!topology.gpus.empty()) {
    const int gpu_count = int(topology.gpus.size());
    decision.gpu = rank % gpu_count;
    if (placement.local_size > gpu_count)
      decision.notes.push_back(std::to_string(placement.local_size) + " local ranks share " +
                               std::to_string(gpu_count) + " GPUs");
    const int numa = topology.gpus[*decision.gpu].pci.numa_node;
    const bool known = std::any_of(topology.numa_nodes.begin(), topology.numa_nodes.end(),
                                   [&](const NumaNode& node) { return node.id == numa; });
    if (known)
      numa_ids.push_back(numa);
    else if (numa_count == 1)
      numa_ids.push_back(topology.numa_nodes.front().id);
    else
      decision.notes.push_back("the GPU's NUMA node is unknown: no CPU binding");
  } else if (numa_count > 0) {
    const int size = placement.local_size;
    if (size >= numa_count) {
      numa_ids.push_back(topology.numa_nodes[size_t(rank) * numa_count / size].id);
    } else {
      for (int n = 0; n < numa_count; ++n)
        if (n * size / numa_count == rank) numa_ids.push_back(topology.numa_nodes[n].id);
    }
  }
  decision.numa_nodes = numa_ids;
  std::vector<int> node_cpus;
  for (const NumaNode& node : topology.numa_nodes)
    if (std::find(numa_ids.begin(), numa_ids.end(), node.id) != numa_ids.end())
      node_cpus.insert(node_cpus.end(), node.cpus.begin(), node.cpus.end());
  std::sort(node_cpus.begin(), node_cpus.end());
  decision.cpus = intersect(node_cpus, topology.allowed_cpus);
  if (decision.cpus.empty() && !node_cpus.empty())
    decision.notes.push_back("the CPUs of NUMA node(s) " + format_cpu_list(numa_ids) +
                             " are outside this process's allowed CPUs (" + format_cpu_list(topology.allowed_cpus) +
                             "): no CPU binding");

  // RDMA ports.
  if (!active.empty() && decision.gpu) {
    const Gpu& gpu = topology.gpus[*decision.gpu];
    const auto mine = nearest_ports(gpu, active, numa_count);
    const std::string key = same_ports_key(mine);
    int ordinal = 0, sharing = 0;  // this GPU's place among the GPUs with the same nearest ports
    for (const Gpu& other : topology.gpus) {
      if (same_ports_key(nearest_ports(other, active, numa_count)) != key) continue;
      if (other.index < gpu.index) ++ordinal;
      ++sharing;
    }
    const int ports = int(mine.size());
    if (ports >= sharing) {
      for (int j = ordinal; j < ports; j += sharing)
        decision.rdma.push_back(make_choice(mine[j].first, mine[j].second));
    } else {
      const auto& [ref, relation] = mine[ordinal % ports];
      decision.rdma.push_back(make_choice(ref, relation));
    }
  } else if (!active.empty()) {
    std::vector<PortRef> local;
    for (const PortRef& ref : active)
      if (std::find(numa_ids.begin(), numa_ids.end(), ref.device->pci.numa_node) != numa_ids.end())
        local.push_back(ref);
    if (local.empty()) local = active;
    decision.rdma.push_back(make_choice(local[size_t(rank) % local.size()], std::nullopt));
  }
  if (decision.rdma.size() > 1 && decision.rdma.front().roce) {
    auto gid_of = [&](const RdmaChoice& choice) {
      for (const PortRef& ref : active)
        if (ref.device->name == choice.device && ref.port->number == choice.port) return ref.port->roce_v2_gid_index;
      return -1;
    };
    const int first_gid = gid_of(decision.rdma.front());
    std::erase_if(decision.rdma, [&](const RdmaChoice& choice) {
      const bool differs = gid_of(choice) != first_gid;
      if (differs)
        decision.notes.push_back(port_name(choice) + " left out: its RoCE v2 GID index differs from " +
                                 port_name(decision.rdma.front()) + "'s");
      return differs;
    });
  }
  decision.transport = decision.rdma.empty() ? "TCP" : decision.rdma.front().roce ? "RoCE" : "InfiniBand";
  decision.socket_interface = socket_interface(topology);

  // The variables.
  std::string hca_list, ucx_list;
  for (const RdmaChoice& choice : decision.rdma) {
    hca_list += (hca_list.empty() ? "=" : ",") + port_name(choice);
    ucx_list += (ucx_list.empty() ? "" : ",") + port_name(choice);
  }
  if (decision.gpu) {
    const Gpu& gpu = topology.gpus[*decision.gpu];
    add_setting(decision, environment, "CUDA_DEVICE_ORDER", "PCI_BUS_ID",
                "number GPUs in PCI bus order, as this decision and NVML do");
    add_setting(
        decision, environment, "CUDA_VISIBLE_DEVICES", std::to_string(gpu.index),
        "GPU " + std::to_string(gpu.index) + " (" + gpu.pci.address + ") for local rank " + std::to_string(rank));
    if (!decision.rdma.empty()) {
      const RdmaChoice& first = decision.rdma.front();
      add_setting(decision, environment, "NCCL_IB_HCA", hca_list,
                  std::string("the ACTIVE port(s) nearest the GPU: ") + describe(*first.relation) + " (" +
                      nccl_level(*first.relation) + ")");
      if (first.roce) {
        int gid = -1;
        for (const PortRef& ref : active)
          if (ref.device->name == first.device && ref.port->number == first.port) gid = ref.port->roce_v2_gid_index;
        if (gid >= 0)
          add_setting(decision, environment, "NCCL_IB_GID_INDEX", std::to_string(gid),
                      "the RoCE v2 GID of " + port_name(first) + " (IPv4-mapped preferred)");
        else
          decision.notes.push_back(port_name(first) +
                                   " has no RoCE v2 GID (no IP address on its interface?): NCCL_IB_GID_INDEX not set");
      }
      const bool direct = *first.relation <= PcieRelation::switch_hierarchy;
      add_setting(decision, environment, "NCCL_NET_GDR_LEVEL", direct ? nccl_level(*first.relation) : "LOC",
                  direct ? std::string("GPUDirect RDMA: GPU and NIC on the ") + describe(*first.relation)
                         : std::string("no GPUDirect RDMA through the host bridge (") + describe(*first.relation) +
                               "): staged in host memory");
    } else {
      add_setting(decision, environment, "NCCL_IB_DISABLE", "1", "no ACTIVE RDMA port: NCCL uses TCP sockets");
    }
    if (!decision.socket_interface.empty())
      add_setting(decision, environment, "NCCL_SOCKET_IFNAME", "=" + decision.socket_interface,
                  "bootstrap (and TCP) on the interface with the default route");
  }
  if (!decision.rdma.empty()) {
    add_setting(decision, environment, "UCX_NET_DEVICES", ucx_list, "MPI traffic through the rank's RDMA port(s)");
    add_setting(decision, environment, "OMPI_MCA_pml", "ucx", "Open MPI over UCX on " + decision.transport);
    add_setting(decision, environment, "OMPI_MCA_btl", "^openib",
                "the UCX PML drives RDMA; the old openib BTL stays off");
  } else {
    add_setting(decision, environment, "OMPI_MCA_pml", "ob1", "no RDMA: Open MPI's ob1 PML");
    add_setting(decision, environment, "OMPI_MCA_btl", "self,vader,tcp", "shared memory within the node, TCP between");
    if (!decision.socket_interface.empty())
      add_setting(decision, environment, "OMPI_MCA_btl_tcp_if_include", decision.socket_interface,
                  "TCP between nodes on the interface with the default route");
  }
  if (!decision.cpus.empty())
    add_setting(decision, environment, "TESSERA_CPU_BIND", format_cpu_list(decision.cpus),
                "the CPUs of NUMA node " + format_cpu_list(numa_ids) + " (scripts/tessera-rank binds with taskset)");
  return decision;
}

namespace {

// Columns padded to their widest cell, two spaces apart.
std::string table(const std::vector<std::vector<std::string>>& rows, const std::string& indent = "  ") {
  std::vector<size_t> widths;
  for (const auto& row : rows)
    for (size_t i = 0; i < row.size(); ++i) {
      if (widths.size() <= i) widths.push_back(0);
      widths[i] = std::max(widths[i], row[i].size());
    }
  std::string text;
  for (const auto& row : rows) {
    std::string line = indent;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line += std::string(widths[i] - row[i].size() + 2, ' ');
    }
    text += trim(line).empty() ? "\n" : line.substr(0, line.find_last_not_of(' ') + 1) + "\n";
  }
  return text;
}

std::string numa_text(int node) {
  return node < 0 ? "?" : std::to_string(node);
}

std::string gbps_text(double gbps) {
  char text[32];
  std::snprintf(text, sizeof text, "%g Gb/s", gbps);
  return text;
}

// "GPU 0 (0000:15:00.0, NUMA 0); mlx5_0:1 InfiniBand 200 Gb/s, same PCIe switch (PIX); CPUs 0-31 (NUMA 0)"
std::string decision_line(const Topology& topology, const TopologyDecision& decision) {
  std::string line;
  if (decision.gpu) {
    const Gpu& gpu = topology.gpus[*decision.gpu];
    line +=
        "GPU " + std::to_string(gpu.index) + " (" + gpu.pci.address + ", NUMA " + numa_text(gpu.pci.numa_node) + ")";
  } else {
    line += "no GPU";
  }
  if (decision.rdma.empty()) {
    line += "; TCP" + (decision.socket_interface.empty() ? "" : " on " + decision.socket_interface);
  }
  for (const RdmaChoice& choice : decision.rdma) {
    line += "; " + port_name(choice) + " " + (choice.roce ? "RoCE" : "InfiniBand") + " " + gbps_text(choice.gbps);
    if (choice.relation)
      line += std::string(", ") + describe(*choice.relation) + " (" + nccl_level(*choice.relation) + ")";
  }
  line += "; CPUs " + (decision.cpus.empty()
                           ? std::string("not bound")
                           : format_cpu_list(decision.cpus) + " (NUMA " + format_cpu_list(decision.numa_nodes) + ")");
  return line;
}

std::string shell_quote(const std::string& value) {
  std::string quoted = "'";
  for (char c : value) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

}  // namespace

std::string format_topology_table(const Topology& topology, const TopologyDecision& decision) {
  const int numa_count = int(topology.numa_nodes.size());
  std::string text = "topology of " + topology.root + " (GPUs from " + topology.gpu_source + ")\n";

  text += "\nGPUs: " + std::to_string(topology.gpus.size()) + "\n";
  if (!topology.gpus.empty()) {
    std::vector<PortRef> active;
    for (const RdmaDevice& device : topology.rdma_devices)
      for (const RdmaPort& port : device.ports)
        if (port.active()) active.push_back({&device, &port});
    std::vector<std::vector<std::string>> rows{{"gpu", "pci", "numa", "nearest RDMA ports"}};
    for (const Gpu& gpu : topology.gpus) {
      std::string nearest;
      for (const auto& [ref, relation] : nearest_ports(gpu, active, numa_count))
        nearest += (nearest.empty() ? "" : ", ") + ref.device->name + ":" + std::to_string(ref.port->number) + " " +
                   nccl_level(relation);
      rows.push_back(
          {std::to_string(gpu.index), gpu.pci.address, numa_text(gpu.pci.numa_node), nearest.empty() ? "-" : nearest});
    }
    text += table(rows);
  }

  text += "\nRDMA devices: " + std::to_string(topology.rdma_devices.size()) + "\n";
  if (!topology.rdma_devices.empty()) {
    std::vector<std::vector<std::string>> rows{
        {"device", "port", "state", "link", "rate", "gid", "netdev", "pci", "numa"}};
    for (const RdmaDevice& device : topology.rdma_devices) {
      std::string netdevs;
      for (const std::string& net : device.netdevs) netdevs += (netdevs.empty() ? "" : ",") + net;
      for (const RdmaPort& port : device.ports)
        rows.push_back({device.name, std::to_string(port.number), port.state, port.roce() ? "RoCE" : "InfiniBand",
                        gbps_text(port.gbps),
                        port.roce_v2_gid_index >= 0 ? std::to_string(port.roce_v2_gid_index) : "-",
                        netdevs.empty() ? "-" : netdevs, device.pci.address, numa_text(device.pci.numa_node)});
    }
    text += table(rows);
  }

  text += "\nInterfaces:\n";
  std::vector<std::vector<std::string>> nets{{"name", "state", "kind", "routes", "rdma"}};
  for (const NetInterface& net : topology.interfaces) {
    const std::string kind = net.type == 772  ? "loopback"
                             : !net.on_device ? "virtual"
                             : net.type == 32 ? "IPoIB"
                                              : "Ethernet";
    const std::string routes = net.default_route ? "default" : net.has_route ? "yes" : "-";
    nets.push_back({net.name, net.operstate, kind, routes, net.rdma_device.empty() ? "-" : net.rdma_device});
  }
  text += table(nets);

  text += "\nNUMA nodes:\n";
  std::vector<std::vector<std::string>> nodes;
  for (const NumaNode& node : topology.numa_nodes)
    nodes.push_back({"node " + std::to_string(node.id), "cpus " + format_cpu_list(node.cpus)});
  text += table(nodes);
  if (!topology.allowed_cpus.empty())
    text += "  this process may run on cpus " + format_cpu_list(topology.allowed_cpus) + "\n";

  text += "\nLocal rank " + std::to_string(decision.placement.local_rank) + " of " +
          std::to_string(decision.placement.local_size) + ": " + decision_line(topology, decision) + "\n";
  std::vector<std::vector<std::string>> settings;
  for (const Setting& setting : decision.settings)
    settings.push_back(
        {setting.name + "=" + setting.value,
         setting.kept ? "kept from the environment (computed: " + setting.computed + ")" : setting.reason});
  text += table(settings);
  for (const std::string& note : topology.notes) text += "  note: " + note + "\n";
  for (const std::string& note : decision.notes) text += "  note: " + note + "\n";
  return text;
}

std::string format_decision_env(const Topology& topology, const TopologyDecision& decision) {
  std::string text = "# tessera topo: local rank " + std::to_string(decision.placement.local_rank) + " of " +
                     std::to_string(decision.placement.local_size) + ": " + decision_line(topology, decision) + "\n";
  for (const std::string& note : topology.notes) text += "# note: " + note + "\n";
  for (const std::string& note : decision.notes) text += "# note: " + note + "\n";
  for (const Setting& setting : decision.settings) {
    if (setting.kept)
      text += "# kept from the environment: " + setting.name + "=" + setting.value + " (computed: " + setting.computed +
              ")\n";
    else
      text += "export " + setting.name + "=" + shell_quote(setting.value) + "\n";
  }
  return text;
}

std::string summarize_decision(const Topology& topology, const TopologyDecision& decision) {
  std::string text = "topology: local rank " + std::to_string(decision.placement.local_rank) + " of " +
                     std::to_string(decision.placement.local_size) + ": " + decision_line(topology, decision) + "\n";
  std::string in_effect, missing;
  for (const Setting& setting : decision.settings) {
    if (setting.kept)
      in_effect += " " + setting.name + "=" + setting.value;
    else
      missing += " " + setting.name + "=" + setting.value;
  }
  if (!in_effect.empty()) text += "topology: in effect:" + in_effect + "\n";
  if (!missing.empty())
    text +=
        "topology: computed but not in this process's environment (launch through scripts/tessera-rank):" + missing +
        "\n";
  for (const std::string& note : topology.notes) text += "topology: note: " + note + "\n";
  for (const std::string& note : decision.notes) text += "topology: note: " + note + "\n";
  return text;
}

std::string describe_topology_decision(int local_rank, int local_size, const std::string& sysfs_root) {
  const Topology topology = discover_topology(sysfs_root);
  return summarize_decision(topology, decide_topology(topology, {local_rank, local_size}, process_environment()));
}

}  // namespace tessera::parallel
