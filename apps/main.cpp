// The `tessera` command line:
//   tessera train       train a model (flags and/or --config FILE.toml)
//   tessera prepare     turn IDX images or text files into Tessera's HDF5 datasets
//   tessera plot        draw loss and throughput curves from a metrics file
//   tessera checkpoint  inspect and verify checkpoints (inspect PATH, list DIR)
//   tessera topo        this node's GPUs, RDMA ports, NUMA nodes and each local rank's NCCL/UCX/MPI settings
//   tessera info        this build's backends, devices and libraries
//   tessera selfcheck   every operator checked on this machine's CPU (and GPU)
//   tessera --version   the build: version, CUDA, cuDNN, NCCL, MPI, HDF5, BLAS
// Only main() catches errors: it prints them (with rank and call site) and exits non-zero;
// under several MPI ranks it then calls MPI_Abort, so a rank that fails never
// leaves the others waiting in a collective.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>

#include "apps/checkpoint_command.h"
#include "apps/plot_command.h"
#include "apps/prepare_command.h"
#include "apps/selfcheck.h"
#include "apps/topo_command.h"
#include "apps/train_config.h"
#include "apps/trainer.h"
#include "core/context.h"
#include "core/cpu_libraries.h"
#include "core/cuda_runtime.h"
#include "core/error.h"
#include "io/hdf5_version.h"
#include "parallel/library_versions.h"
#include "parallel/mpi_env.h"

namespace {

std::string build_description() {
  tessera::Context ctx;
  std::string text = std::string("tessera ") + TESSERA_VERSION + "\n";
  text += std::string("cuda backend: ") + (tessera::cuda_runtime::compiled() ? "built" : "not built") + "\n";
  text += ctx.describe() + "\n";
  text += "cpu libraries: " + tessera::describe_cpu_libraries() + "\n";
  text += "mpi: " + tessera::mpi_library_version() + "\n";
  text += "nccl: " + tessera::nccl_library_version() + "\n";
  text += "hdf5: " + tessera::hdf5_library_version() + "\n";
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tessera: data-, tensor- and pipeline-parallel training on MPI ranks"};
  app.require_subcommand(0, 1);
  int exit_code = 0;
  bool show_version = false;
  app.add_flag("--version", show_version, "Print the build (CUDA, cuDNN, NCCL, MPI, HDF5, BLAS) and exit");

  // MPI for the life of the process, started by `train` only (the other
  // subcommands need no MPI); declared here so it outlives the catch below.
  std::optional<tessera::parallel::MpiEnv> mpi;
  tessera::app::TrainConfig train_config;
  auto* train = app.add_subcommand("train", "Train a model on a prepared dataset (or --synthetic data)");
  tessera::app::add_train_options(*train, train_config);
  train->callback([&] {
    mpi.emplace();
    tessera::app::apply_config_file(*train, train_config);
    // 0, or 128 + signal when SIGTERM/SIGUSR1 stopped a run with no --save.
    exit_code = tessera::app::train(train_config).exit_code();
  });

  tessera::app::register_prepare_command(app, exit_code);
  tessera::app::register_plot_command(app, exit_code);
  tessera::app::register_checkpoint_command(app, exit_code);
  tessera::app::register_topo_command(app, exit_code);

  auto* info = app.add_subcommand("info", "Show this build's backends, devices and libraries");
  info->callback([] { std::printf("%s", build_description().c_str()); });

  tessera::app::SelfcheckOptions selfcheck_options;
  auto* selfcheck = app.add_subcommand("selfcheck", "Check every operator's forward and backward on this machine");
  selfcheck->add_option("--seed", selfcheck_options.seed, "Seed of the random inputs");
  selfcheck->callback([&] { exit_code = tessera::app::run_selfcheck(selfcheck_options); });

  try {
    app.parse(argc, argv);
    if (show_version) {
      std::printf("%s", build_description().c_str());
      return 0;
    }
    if (app.get_subcommands().empty()) {
      std::printf("%s", app.help().c_str());
      return 2;
    }
  } catch (const CLI::ParseError& error) {
    // Under a launcher every rank parses the same bad command line: say which rank speaks.
    const int rank = tessera::launcher_rank();
    if (rank >= 0 && error.get_exit_code() != 0) std::fprintf(stderr, "tessera: [rank %d] bad command line:\n", rank);
    return app.exit(error);
  } catch (const std::exception& error) {
    if (mpi && mpi->world_size() > 1) {
      std::fprintf(stderr, "tessera: %s\ntessera: rank %d failed; aborting all %d ranks\n", error.what(),
                   mpi->world_rank(), mpi->world_size());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);  // the other ranks may be waiting in a collective
    }
    std::fprintf(stderr, "tessera: %s\n", error.what());
    return 1;
  }
  return exit_code;
}
