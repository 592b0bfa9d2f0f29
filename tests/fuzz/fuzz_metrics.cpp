// libFuzzer harness: `tessera plot` on a fuzzed metrics JSONL file (the file
// a user hands back to Tessera): the flat-JSON parser, read_metrics (step,
// eval and run lines, duplicates, a cut-off last line) and the SVG renderer
// (axes and ticks of any values: NaN, infinities, huge or equal ones, one
// point or thousands), with fuzzed plot sizes. A bad file must end in
// tessera::Error naming it; any file that reads must render. Never a crash,
// a hang, a runaway allocation or undefined behaviour.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_support.h"
#include "io/metrics.h"
#include "io/plot.h"

using namespace tessera;
using namespace tessera::fuzz;

// The input: a byte of plot options, then the metrics file.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  if (size < 1) return 0;
  const std::string_view text(reinterpret_cast<const char*>(bytes) + 1, size - 1);
  io::PlotOptions options;
  options.width = 200 + 100 * (bytes[0] & 7);
  options.panel_height = 100 + 40 * ((bytes[0] >> 3) & 3);
  options.max_points = bytes[0] & 0x20 ? 4 : 2000;
  if (bytes[0] & 0x40) options.title = std::string(text.substr(0, 16));

  expect_clean_errors([&] {
    const size_t line_end = text.find('\n');
    io::parse_flat_json_object(text.substr(0, line_end));
  });
  const fs::path dir = fresh_scratch_dir();
  write_file(dir / "metrics.jsonl", text);
  expect_clean_errors(
      [&] { io::plot_metrics((dir / "metrics.jsonl").string(), (dir / "curves.svg").string(), options); });
  return 0;
}
