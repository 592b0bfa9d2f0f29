// `tessera topo` run in-process through CLI11 on the fixture trees: the
// table (GPUs with their nearest ports, RDMA ports, the decision with each
// variable's reason), JSON (the decision's fields), and the env lines, which
// are evaluated by a real bash to show the quoting survives (values such as
// "=mlx5_2:1" and "^openib"); the local rank from the launcher's variables;
// and the errors for a missing root and an unknown format.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "apps/topo_command.h"
#include "core/error.h"
#include "tests/support/cli_capture.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

std::string fixture(const std::string& name) {
  return (fs::path(TESSERA_TOPOLOGY_FIXTURES) / name).string();
}

struct CliRun {
  int exit_code = -1;
  std::string out;
};

CliRun run_topo(std::vector<std::string> args) {
  CLI::App app;
  CliRun run;
  app::register_topo_command(app, run.exit_code);
  args.insert(args.begin(), "topo");
  run.out = parse_capturing_stdout(app, args);
  return run;
}

// Clears the launcher variables for one test and restores nothing: the test
// binary is never started by a launcher.
void clear_launcher_variables() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_LOCALID",
                           "MPI_LOCALRANKID", "PMIX_LOCAL_RANK", "NCCL_IB_HCA", "CUDA_VISIBLE_DEVICES"})
    unsetenv(name);
}

TEST(TopoCommand, TableOnDgx8) {
  clear_launcher_variables();
  const CliRun run = run_topo({"--sysfs-root", fixture("dgx8"), "--local-rank", "6"});
  EXPECT_EQ(run.exit_code, 0);
  for (const char* expected : {
           "GPUs: 8\n",
           "  6    0000:b5:00.0  1     mlx5_6:1 PIX\n",
           "  mlx5_6  1     ACTIVE  InfiniBand  200 Gb/s  -    ib6     0000:b6:00.0  1\n",
           "  node 1  cpus 32-63,96-127\n",
           "Local rank 6 of 8: GPU 6 (0000:b5:00.0, NUMA 1); mlx5_6:1 InfiniBand 200 Gb/s, same PCIe switch (PIX); "
           "CPUs 32-63,96-127 (NUMA 1)\n",
           "  NCCL_IB_HCA==mlx5_6:1 ",
           "  NCCL_NET_GDR_LEVEL=PIX ",
       })
    EXPECT_NE(run.out.find(expected), std::string::npos) << "missing: " << expected << "\nin:\n" << run.out;
}

TEST(TopoCommand, JsonOnRoce2) {
  clear_launcher_variables();
  const CliRun run = run_topo({"--sysfs-root", fixture("roce2"), "--format", "json", "--local-rank", "1"});
  EXPECT_EQ(run.exit_code, 0);
  ASSERT_FALSE(run.out.empty());
  EXPECT_EQ(run.out.front(), '{');
  EXPECT_EQ(run.out.substr(run.out.size() - 2), "}\n");
  for (
      const char* expected : {
          R"("gpu_source":"sysfs")",
          R"("decision":{"local_rank":1,"local_size":2,"gpu":1,"transport":"RoCE")",
          R"("rdma":[{"device":"mlx5_1","port":1,"roce":true,"gbps":100,"pcie":"PHB","relation":"same root complex"}])",
          R"({"name":"NCCL_IB_GID_INDEX","value":"5","computed":"5","kept":false,)",
          R"({"name":"NCCL_NET_GDR_LEVEL","value":"LOC",)",
          R"("roce_v2_gid_index":3)",
      })
    EXPECT_NE(run.out.find(expected), std::string::npos) << "missing: " << expected << "\nin:\n" << run.out;
}

TEST(TopoCommand, EnvLinesSurviveBash) {
  clear_launcher_variables();
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2", 1);  // the default --local-rank
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8", 1);
  const CliRun run = run_topo({"--sysfs-root", fixture("dgx8"), "--format", "env"});
  clear_launcher_variables();
  unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_EQ(run.out.rfind("# tessera topo: local rank 2 of 8: GPU 2 (0000:35:00.0, NUMA 0); mlx5_2:1", 0), 0u)
      << run.out;

  const fs::path script = fs::temp_directory_path() / ("tessera_topo_env_" + std::to_string(getpid()) + ".sh");
  {
    std::ofstream file(script);
    file << run.out
         << "printf '%s|' \"$CUDA_VISIBLE_DEVICES\" \"$NCCL_IB_HCA\" \"$NCCL_NET_GDR_LEVEL\" "
            "\"$NCCL_SOCKET_IFNAME\" \"$UCX_NET_DEVICES\" \"$OMPI_MCA_btl\" \"$TESSERA_CPU_BIND\"\n";
  }
  FILE* shell = popen(("env -i bash " + script.string()).c_str(), "r");
  ASSERT_NE(shell, nullptr);
  std::string values;
  char buffer[256];
  while (std::fgets(buffer, sizeof buffer, shell)) values += buffer;
  EXPECT_EQ(pclose(shell), 0);
  fs::remove(script);
  EXPECT_EQ(values, "2|=mlx5_2:1|PIX|=eno1|mlx5_2:1|^openib|0-31,64-95|");
}

TEST(TopoCommand, LocalSizeDefaultsToTheGpuCount) {
  clear_launcher_variables();
  const CliRun run = run_topo({"--sysfs-root", fixture("tcp-only"), "--format", "env"});
  EXPECT_NE(run.out.find("local rank 0 of 4: GPU 0"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("export NCCL_IB_DISABLE='1'\n"), std::string::npos) << run.out;
}

TEST(TopoCommand, Errors) {
  clear_launcher_variables();
  try {
    run_topo({"--sysfs-root", "/nonexistent/root"});
    FAIL() << "no error for a missing root";
  } catch (const Error& error) {
    EXPECT_NE(error.message().find("'/nonexistent/root' is not a directory"), std::string::npos) << error.message();
  }
  EXPECT_THROW(run_topo({"--sysfs-root", fixture("dgx8"), "--format", "yaml"}), CLI::ValidationError);
  EXPECT_THROW(run_topo({"--sysfs-root", fixture("dgx8"), "--local-rank", "3", "--local-size", "2"}), Error);
}

}  // namespace
}  // namespace tessera::testing
