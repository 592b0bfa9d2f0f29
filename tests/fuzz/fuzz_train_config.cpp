// libFuzzer harness: the `tessera train` settings (apps/train_config.h) from
// a fuzzed TOML file (--config) and fuzzed command-line arguments, parsed
// the way apps/main.cpp does (CLI11, then apply_config_file), then
// validated, echoed and listed as checkpoint settings. Bad files and flags
// must end in CLI11's parse errors or tessera::Error, never a crash, a leak
// or undefined behaviour. A configuration that validates must also survive
// the round trip the checkpoints rely on: its settings() given back as
// flags give the same settings.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "apps/train_config.h"
#include "fuzz_support.h"

namespace {

using namespace tessera;
using namespace tessera::fuzz;
using Settings = std::vector<std::pair<std::string, std::string>>;

// Parses `args` (without the program name) as `tessera train ...`, applies
// the config file it names, validates; returns the settings, or nothing when
// the arguments were refused (saying why in `why`).
std::optional<Settings> parse(const std::vector<std::string>& args, std::string& why) {
  CLI::App app{"tessera"};
  app.require_subcommand(0, 1);
  app::TrainConfig config;
  CLI::App* train = app.add_subcommand("train");
  app::add_train_options(*train, config);
  std::vector<const char*> argv = {"tessera"};
  for (const std::string& arg : args) argv.push_back(arg.c_str());
  try {
    app.parse(int(argv.size()), argv.data());
    app::apply_config_file(*train, config);
    app::validate(config);
  } catch (const CLI::Error& error) {
    why = error.what();
    return std::nullopt;
  } catch (const tessera::Error& error) {
    why = error.what();
    return std::nullopt;
  }
  (void)app::describe(config);
  return app::settings(config);
}

}  // namespace

// The input: the TOML file, then (after the first NUL byte, if any) up to 24
// command-line arguments, one per line.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(bytes), size);
  const size_t split = input.find('\0');
  const fs::path toml = fresh_scratch_dir() / "run.toml";
  write_file(toml, input.substr(0, split));

  std::vector<std::string> args = {"train", "--config", toml.string()};
  if (split != std::string_view::npos) {
    std::string_view rest = input.substr(split + 1);
    while (!rest.empty() && args.size() < 27) {
      const size_t end = rest.find('\n');
      args.emplace_back(rest.substr(0, end));
      rest = end == std::string_view::npos ? std::string_view() : rest.substr(end + 1);
    }
  }
  std::string why;
  const std::optional<Settings> settings = parse(args, why);
  if (!settings) return 0;

  // The round trip: every setting back as --key=value (no config file; an
  // empty value, which CLI11 cannot take as --key=, left at its default).
  std::vector<std::string> again = {"train"};
  for (const auto& [key, value] : *settings)
    if (key != "config" && !value.empty()) again.push_back("--" + key + "=" + value);
  const std::optional<Settings> reparsed = parse(again, why);
  Settings expected = *settings;
  for (auto& [key, value] : expected)
    if (key == "config") value.clear();
  if (reparsed != expected) {
    std::fprintf(stderr, "fuzz: settings() of a valid configuration do not parse back to the same settings\n");
    if (!reparsed) std::fprintf(stderr, "  they were refused: %s\n", why.c_str());
    if (reparsed)
      for (size_t i = 0; i < expected.size(); ++i)
        if (expected[i] != (*reparsed)[i])
          std::fprintf(stderr, "  %s: '%s' came back as '%s'\n", expected[i].first.c_str(), expected[i].second.c_str(),
                       (*reparsed)[i].second.c_str());
    std::abort();
  }
  return 0;
}
