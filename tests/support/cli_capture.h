// Runs a `tessera` subcommand registered on a CLI::App in-process and
// returns what it printed to stdout (the tests of `tessera topo` and
// `tessera schedule` read their output this way); an exception from the
// command or from CLI11's checks propagates after stdout is released.
#pragma once

#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace tessera::testing {

// `args` are the words after `tessera`: the subcommand's name, then its flags.
inline std::string parse_capturing_stdout(CLI::App& app, const std::vector<std::string>& args) {
  std::vector<const char*> argv{"tessera"};
  for (const std::string& arg : args) argv.push_back(arg.c_str());
  ::testing::internal::CaptureStdout();
  try {
    app.parse(int(argv.size()), argv.data());
  } catch (...) {
    ::testing::internal::GetCapturedStdout();
    throw;
  }
  return ::testing::internal::GetCapturedStdout();
}

}  // namespace tessera::testing
