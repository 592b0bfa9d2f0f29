// Formatting of tessera::Error and the launcher-rank lookup used in messages.
#include "core/error.h"

#include <cstdlib>
#include <string>

#include "core/dtype.h"

namespace tessera {
namespace {

std::string format_what(const ErrorSite& site, const std::string& message, int rank) {
  std::ostringstream out;
  if (rank >= 0) out << "[rank " << rank << "] ";
  out << site.library << " error";
  if (site.library != "tessera") {
    out << " " << site.code;
    if (!site.code_name.empty()) out << " (" << site.code_name << ")";
  }
  out << ": " << message;
  out << "\n  at " << site.file << ":" << site.line;
  if (!site.statement.empty()) out << " in `" << site.statement << "`";
  if (site.device) out << " on " << site.device->to_string();
  return out.str();
}

}  // namespace

Error::Error(const ErrorSite& site, std::string message)
    : std::runtime_error(format_what(site, message, launcher_rank())),
      library_(site.library),
      message_(std::move(message)),
      file_(site.file),
      statement_(site.statement),
      code_(site.code),
      line_(site.line),
      device_(site.device),
      rank_(launcher_rank()) {}

int launcher_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0') {
      char* end = nullptr;
      const long rank = std::strtol(value, &end, 10);
      if (end != value && *end == '\0' && rank >= 0) return int(rank);
    }
  }
  return -1;
}

void throw_error(const ErrorSite& site, std::string message) {
  throw Error(site, std::move(message));
}

void throw_unsupported_dtype(DType dtype, std::string_view what) {
  TESSERA_THROW(what, " does not support dtype ", dtype_name(dtype));
}

}  // namespace tessera
