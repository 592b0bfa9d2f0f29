// The `topo` subcommand: flags (defaults for the local rank and size from the
// launcher's variables), discovery under --sysfs-root, the decision with this
// process's environment, and the three output formats (the JSON one here,
// where io/'s JSON string and number helpers are at hand).
#include "apps/topo_command.h"

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/metrics.h"

namespace tessera::app {
namespace {

using namespace tessera::parallel;

struct TopoOptions {
  std::string sysfs_root = "/";
  std::string format = "table";
  std::optional<int> local_rank, local_size;
};

std::string json_list(const std::vector<std::string>& items) {
  std::string text = "[";
  for (size_t i = 0; i < items.size(); ++i) text += (i ? "," : "") + items[i];
  return text + "]";
}

std::string json_ints(const std::vector<int>& values) {
  std::vector<std::string> items;
  for (int value : values) items.push_back(std::to_string(value));
  return json_list(items);
}

std::string json_strings(const std::vector<std::string>& values) {
  std::vector<std::string> items;
  for (const std::string& value : values) items.push_back(io::json_string(value));
  return json_list(items);
}

// {"key":value,...} from pairs whose values are already JSON.
std::string json_object(const std::vector<std::pair<std::string, std::string>>& fields) {
  std::string text = "{";
  for (size_t i = 0; i < fields.size(); ++i)
    text += (i ? "," : "") + io::json_string(fields[i].first) + ":" + fields[i].second;
  return text + "}";
}

std::string json_pci(const PciLocation& pci) {
  return json_object({{"address", io::json_string(pci.address)},
                      {"path", json_strings(pci.path)},
                      {"numa_node", std::to_string(pci.numa_node)}});
}

const char* json_bool(bool value) {
  return value ? "true" : "false";
}

}  // namespace

std::string format_decision_json(const Topology& topology, const TopologyDecision& decision) {
  std::vector<std::string> gpus, devices, interfaces, nodes, rdma, settings;
  for (const Gpu& gpu : topology.gpus)
    gpus.push_back(json_object({{"index", std::to_string(gpu.index)},
                                {"device_id", io::json_string(gpu.device_id)},
                                {"pci", json_pci(gpu.pci)}}));
  for (const RdmaDevice& device : topology.rdma_devices) {
    std::vector<std::string> ports;
    for (const RdmaPort& port : device.ports)
      ports.push_back(json_object({{"port", std::to_string(port.number)},
                                   {"state", io::json_string(port.state)},
                                   {"link_layer", io::json_string(port.link_layer)},
                                   {"rate", io::json_string(port.rate)},
                                   {"gbps", io::json_number(port.gbps)},
                                   {"roce_v2_gid_index", std::to_string(port.roce_v2_gid_index)}}));
    devices.push_back(json_object({{"name", io::json_string(device.name)},
                                   {"pci", json_pci(device.pci)},
                                   {"netdevs", json_strings(device.netdevs)},
                                   {"ports", json_list(ports)}}));
  }
  for (const NetInterface& net : topology.interfaces)
    interfaces.push_back(json_object({{"name", io::json_string(net.name)},
                                      {"up", json_bool(net.up)},
                                      {"on_device", json_bool(net.on_device)},
                                      {"type", std::to_string(net.type)},
                                      {"has_route", json_bool(net.has_route)},
                                      {"default_route", json_bool(net.default_route)},
                                      {"rdma_device", io::json_string(net.rdma_device)}}));
  for (const NumaNode& node : topology.numa_nodes)
    nodes.push_back(
        json_object({{"id", std::to_string(node.id)}, {"cpus", io::json_string(format_cpu_list(node.cpus))}}));
  for (const RdmaChoice& choice : decision.rdma)
    rdma.push_back(json_object({{"device", io::json_string(choice.device)},
                                {"port", std::to_string(choice.port)},
                                {"roce", json_bool(choice.roce)},
                                {"gbps", io::json_number(choice.gbps)},
                                {"pcie", choice.relation ? io::json_string(nccl_level(*choice.relation)) : "null"},
                                {"relation", choice.relation ? io::json_string(describe(*choice.relation)) : "null"}}));
  for (const Setting& setting : decision.settings)
    settings.push_back(json_object({{"name", io::json_string(setting.name)},
                                    {"value", io::json_string(setting.value)},
                                    {"computed", io::json_string(setting.computed)},
                                    {"kept", json_bool(setting.kept)},
                                    {"reason", io::json_string(setting.reason)}}));
  const std::string choice = json_object({
      {"local_rank", std::to_string(decision.placement.local_rank)},
      {"local_size", std::to_string(decision.placement.local_size)},
      {"gpu", decision.gpu ? std::to_string(*decision.gpu) : "null"},
      {"transport", io::json_string(decision.transport)},
      {"rdma", json_list(rdma)},
      {"socket_interface", io::json_string(decision.socket_interface)},
      {"numa_nodes", json_ints(decision.numa_nodes)},
      {"cpus", io::json_string(format_cpu_list(decision.cpus))},
      {"settings", json_list(settings)},
      {"notes", json_strings(decision.notes)},
  });
  return json_object({{"root", io::json_string(topology.root)},
                      {"gpu_source", io::json_string(topology.gpu_source)},
                      {"gpus", json_list(gpus)},
                      {"rdma_devices", json_list(devices)},
                      {"interfaces", json_list(interfaces)},
                      {"numa_nodes", json_list(nodes)},
                      {"allowed_cpus", io::json_string(format_cpu_list(topology.allowed_cpus))},
                      {"notes", json_strings(topology.notes)},
                      {"decision", choice}}) +
         "\n";
}

void register_topo_command(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<TopoOptions>();
  auto* topo = app.add_subcommand(
      "topo", "Show this node's GPUs, RDMA ports and NUMA nodes, and the NCCL/UCX/MPI settings for a local rank");
  topo->add_option("--sysfs-root", options->sysfs_root,
                   "The directory holding sys/ and proc/ to read (a fixture tree in tests)")
      ->capture_default_str();
  topo->add_option("--format", options->format, "table (for people), json, or env (export lines for a launch wrapper)")
      ->check(CLI::IsMember({"table", "json", "env"}))
      ->capture_default_str();
  topo->add_option("--local-rank", options->local_rank,
                   "The node-local rank to decide for (default: OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, "
                   "MPI_LOCALRANKID or PMIX_LOCAL_RANK; else 0)")
      ->check(CLI::NonNegativeNumber);
  topo->add_option("--local-size", options->local_size,
                   "Ranks on this node (default: from the same launcher's variables; else the GPU count, or 1 "
                   "without GPUs)")
      ->check(CLI::PositiveNumber);
  topo->callback([options, &exit_code] {
    const Environment environment = process_environment();
    const Topology topology = discover_topology(options->sysfs_root);
    const std::optional<int> launcher_rank = local_rank_from_environment(environment);
    RankPlacement placement;
    placement.local_rank = options->local_rank.value_or(launcher_rank.value_or(0));
    if (options->local_size) {
      placement.local_size = *options->local_size;
    } else if (const auto size = local_size_from_environment(environment); size && launcher_rank) {
      placement.local_size = *size;
    } else {
      placement.local_size = std::max<int>(int(topology.gpus.size()), placement.local_rank + 1);
    }
    const TopologyDecision decision = decide_topology(topology, placement, environment);
    std::string text;
    if (options->format == "json")
      text = format_decision_json(topology, decision);
    else if (options->format == "env")
      text = format_decision_env(topology, decision);
    else
      text = format_topology_table(topology, decision);
    std::fputs(text.c_str(), stdout);
    exit_code = 0;
  });
}

}  // namespace tessera::app
