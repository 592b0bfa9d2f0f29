// The `tessera` command line:
//   tessera train       train a model (flags and/or --config FILE.toml)
//   tessera prepare     turn IDX images or text files into Tessera's HDF5 datasets
//   tessera plot        draw loss and throughput curves from a metrics file
//   tessera checkpoint  inspect and verify checkpoints (inspect PATH, list DIR)
//   tessera export      a checkpoint's weights as safetensors (Tessera's names, or Hugging Face GPT-2's or Llama's)
//   tessera generate    text from a trained GPT (KV cache; tensor-parallel under mpirun)
//   tessera schedule    what each pipeline stage runs in a step of a schedule, drawn over time
//   tessera plan        predicted step time, memory and MFU of every layout of a model on a cluster
//   tessera topo        this node's GPUs, RDMA ports, NUMA nodes and each local rank's NCCL/UCX/MPI settings
//   tessera info        this build's backends, devices and libraries
//   tessera selfcheck   every operator checked on this machine's CPU (and GPU); with --cluster,
//                       under mpirun: the ranks' arithmetic, links and layouts, and the cluster file for `plan`
//   tessera --version   the build: version, CUDA, cuDNN, NCCL, MPI, HDF5, BLAS
// A bad command line is reported as such, with the flag or command a typo or
// another trainer's name meant (--learning-rate: --lr; trian: train).
// Only main() catches errors: it prints them (with rank and call site) and exits non-zero;
// under several MPI ranks it then calls MPI_Abort, so a rank that fails never
// leaves the others waiting in a collective.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "apps/checkpoint_command.h"
#include "apps/generate_command.h"
#include "apps/plan_command.h"
#include "apps/plot_command.h"
#include "apps/prepare_command.h"
#include "apps/process_end.h"
#include "apps/schedule_command.h"
#include "apps/selfcheck.h"
#include "apps/selfcheck_cluster.h"
#include "apps/topo_command.h"
#include "apps/train_config.h"
#include "apps/trainer.h"
#include "core/context.h"
#include "core/cpu_libraries.h"
#include "core/cuda_runtime.h"
#include "core/error.h"
#include "io/hdf5_threads.h"
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
  text += "hdf5: " + tessera::hdf5_library_version() +
          (tessera::io::hdf5_calls_serialised() ? " (not thread-safe: Tessera serialises its HDF5 calls)" : "") + "\n";
  return text;
}

// What was wrong with the command line, one line each. Arguments CLI11 did
// not expect (an ExtrasError) get a suggestion: the flag a typo or another
// trainer's name meant (--learning-rate: --lr), the command a typo meant
// (trian: train), or the command a flag belongs to (tessera --lr 3).
std::vector<std::string> bad_command_line(const CLI::App& app, const CLI::ParseError& error) {
  if (dynamic_cast<const CLI::ExtrasError*>(&error) == nullptr) return {error.what()};
  std::vector<std::string> lines;
  const auto all = [](const CLI::App& command) {
    return command.get_subcommands([](const CLI::App*) { return true; });
  };
  // The arguments `command` (called `path`) did not expect.
  const auto explain = [&](const CLI::App& command, const std::string& path) {
    const std::vector<std::string> args = command.remaining();
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& arg = args[i];
      const bool number = arg.find_first_not_of("0123456789.eE+-") == std::string::npos;
      if (arg.size() > 1 && arg[0] == '-' && !number) {
        const std::string name = arg.substr(0, arg.find('='));
        std::string hint = tessera::app::suggestion_text(tessera::app::suggest_flag(command, arg));
        for (const CLI::App* sub : all(command))
          if (hint.empty() && sub->get_option_no_throw(name) != nullptr)
            hint = "it is a flag of `" + path + " " + sub->get_name() + "`: write it after the command (" + path + " " +
                   sub->get_name() + " " + name + " ...)";
        lines.push_back("unknown flag " + name + " for `" + path + "`" + (hint.empty() ? "" : "; " + hint));
        // The value given to it is an extra of its own: not worth a line.
        const bool valued = arg.find('=') != std::string::npos;
        if (!valued && i + 1 < args.size() && (args[i + 1].empty() || args[i + 1][0] != '-')) ++i;
        continue;
      }
      std::vector<std::string> commands;
      for (const CLI::App* sub : all(command)) commands.push_back(sub->get_name());
      if (commands.empty()) {
        lines.push_back("unexpected argument '" + arg + "' for `" + path + "` (its flags start with --)");
        continue;
      }
      const std::string near = tessera::app::closest_name(arg, commands);
      std::string names;
      for (const std::string& name : commands) names += (names.empty() ? "" : ", ") + name;
      lines.push_back("'" + arg + "' is not a command of `" + path + "`; " +
                      (near.empty() ? "its commands are " + names : "did you mean `" + path + " " + near + "`?"));
      if (!near.empty()) return;  // what follows was meant for that command
    }
  };
  explain(app, "tessera");
  for (const CLI::App* command : app.get_subcommands()) {
    explain(*command, "tessera " + command->get_name());
    for (const CLI::App* sub : command->get_subcommands())
      explain(*sub, "tessera " + command->get_name() + " " + sub->get_name());
  }
  if (lines.empty()) lines.push_back(error.what());
  return lines;
}

}  // namespace

int main(int argc, char** argv) {
  tessera::app::install_process_end_hook();  // how library code ends the job (core/process_end.h)
  tessera::skip_hdf5_shutdown_at_exit();     // no "infinite loop closing library" after a damaged file
  tessera::io::set_up_hdf5_threading(tessera::io::hdf5_library_threadsafe());  // io/hdf5_threads.h
  CLI::App app{"Tessera: data-, tensor- and pipeline-parallel training on MPI ranks"};
  app.require_subcommand(0, 1);
  int exit_code = 0;
  bool show_version = false;
  app.add_flag("--version", show_version, "Print the build (CUDA, cuDNN, NCCL, MPI, HDF5, BLAS) and exit");

  // MPI for the life of the process, started by `train` and `selfcheck
  // --cluster` only (the other subcommands need no MPI); declared here so it
  // outlives the catch below.
  std::optional<tessera::parallel::MpiEnv> mpi;
  tessera::app::TrainConfig train_config;
  auto* train = app.add_subcommand("train", "Train a model on a prepared dataset (or --synthetic data)");
  tessera::app::add_train_options(*train, train_config);
  train->callback([&] {
    mpi.emplace();
    const tessera::app::ConfigFileLines from_file = tessera::app::apply_config_file(*train, train_config);
    tessera::app::refuse_unused_settings(*train, train_config, from_file);
    tessera::app::record_given_flags(*train, train_config);
    // 0, or 128 + signal when SIGTERM/SIGUSR1 stopped a run with no --save.
    exit_code = tessera::app::train(train_config).exit_code();
  });

  tessera::app::register_prepare_command(app, exit_code);
  tessera::app::register_plot_command(app, exit_code);
  tessera::app::register_checkpoint_command(app, exit_code);
  tessera::app::register_export_command(app, exit_code);
  tessera::app::register_generate_command(app, mpi, exit_code);
  tessera::app::register_schedule_command(app, exit_code);
  tessera::app::register_plan_command(app, exit_code);
  tessera::app::register_topo_command(app, exit_code);

  auto* info = app.add_subcommand("info", "Show this build's backends, devices and libraries");
  info->callback([] { std::printf("%s", build_description().c_str()); });

  tessera::app::SelfcheckOptions selfcheck_options;
  auto* selfcheck = app.add_subcommand("selfcheck", "Check every operator's forward and backward on this machine");
  selfcheck->add_option("--seed", selfcheck_options.seed, "Seed of the random inputs");
  bool cluster_check = false;
  tessera::app::ClusterSelfcheckOptions cluster_options;
  selfcheck->add_flag("--cluster", cluster_check,
                      "Under mpirun/srun: check the ranks' arithmetic, links and layouts, measure the machine and "
                      "links, and write the cluster file for `tessera plan --cluster FILE`");
  selfcheck->add_option("--output", cluster_options.output, "With --cluster: the cluster file rank 0 writes")
      ->capture_default_str();
  selfcheck->add_flag("--quick", cluster_options.quick, "With --cluster: fewer sizes and repeats");
  selfcheck->add_option("--threads", cluster_options.threads,
                        "With --cluster: CPU threads per rank while measuring, as `tessera train --threads` will "
                        "train (0: OpenMP's default)");
  selfcheck->callback([&] {
    if (!cluster_check) {
      TESSERA_CHECK(selfcheck->count("--output") == 0 && !cluster_options.quick && selfcheck->count("--threads") == 0,
                    "tessera selfcheck: --output, --quick and --threads go with --cluster (tessera selfcheck "
                    "--cluster ...)");
      exit_code = tessera::app::run_selfcheck(selfcheck_options);
      return;
    }
    mpi.emplace();
    cluster_options.seed = selfcheck_options.seed;
    exit_code = tessera::app::run_cluster_selfcheck(cluster_options, *mpi);
  });

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
    if (error.get_exit_code() == 0) return app.exit(error);  // --help
    // Under a launcher every rank parses the same bad command line: say which rank speaks.
    const int rank = tessera::launcher_rank();
    const std::string prefix = rank >= 0 ? "tessera: [rank " + std::to_string(rank) + "] " : "tessera: ";
    for (const std::string& line : bad_command_line(app, error))
      std::fprintf(stderr, "%sbad command line: %s\n", prefix.c_str(), line.c_str());
    const std::vector<CLI::App*> commands = app.get_subcommands();
    const std::string command = commands.empty() ? "tessera" : "tessera " + commands.front()->get_name();
    std::fprintf(stderr, "%srun `%s --help` for the %s\n", prefix.c_str(), command.c_str(),
                 commands.empty() ? "commands" : "flags");
    return error.get_exit_code();
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
