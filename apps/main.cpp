// The `tessera` command line. Subcommands so far:
//   tessera info        what this build and machine offer (devices, libraries)
// Training, data preparation, topology and checkpoint tools arrive with their issues.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "core/context.h"
#include "core/cuda_runtime.h"

int main(int argc, char** argv) {
  CLI::App app{"Tessera: data-, tensor- and pipeline-parallel training on MPI ranks"};
  app.require_subcommand(1);
  auto* info = app.add_subcommand("info", "Show this build's backends, devices and libraries");
  info->callback([] {
    tessera::Context ctx;
    std::printf("tessera %s\n", "0.1.0");
    std::printf("cuda backend: %s\n", tessera::cuda_runtime::compiled() ? "built" : "not built");
    std::printf("%s\n", ctx.describe().c_str());
  });
  try {
    CLI11_PARSE(app, argc, argv);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "tessera: %s\n", error.what());
    return 1;
  }
  return 0;
}
