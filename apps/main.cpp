// The `tessera` command line. Subcommands so far:
//   tessera info        what this build and machine offer (devices, libraries)
//   tessera selfcheck   every operator checked on this machine's CPU (and GPU)
// Training, data preparation, topology and checkpoint tools arrive with their issues.
// Only main() catches errors: it prints them (with rank and call site) and exits non-zero.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "apps/selfcheck.h"
#include "core/context.h"
#include "core/cuda_runtime.h"
#include "parallel/library_versions.h"

int main(int argc, char** argv) {
  CLI::App app{"Tessera: data-, tensor- and pipeline-parallel training on MPI ranks"};
  app.require_subcommand(1);
  int exit_code = 0;

  auto* info = app.add_subcommand("info", "Show this build's backends, devices and libraries");
  info->callback([] {
    tessera::Context ctx;
    std::printf("tessera %s\n", TESSERA_VERSION);
    std::printf("cuda backend: %s\n", tessera::cuda_runtime::compiled() ? "built" : "not built");
    std::printf("%s\n", ctx.describe().c_str());
    std::printf("mpi: %s\n", tessera::mpi_library_version().c_str());
    std::printf("nccl: %s\n", tessera::nccl_library_version().c_str());
  });

  tessera::app::SelfcheckOptions selfcheck_options;
  auto* selfcheck = app.add_subcommand("selfcheck", "Check every operator's forward and backward on this machine");
  selfcheck->add_option("--seed", selfcheck_options.seed, "Seed of the random inputs");
  selfcheck->callback([&] { exit_code = tessera::app::run_selfcheck(selfcheck_options); });

  try {
    CLI11_PARSE(app, argc, argv);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "tessera: %s\n", error.what());
    return 1;
  }
  return exit_code;
}
