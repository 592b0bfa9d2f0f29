// MPI error text and library version.
#include "parallel/mpi_check.h"

#include "parallel/library_versions.h"

namespace tessera {

std::string detail::mpi_error_text(int status) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(status, text, &length) != MPI_SUCCESS) return "unknown MPI error";
  return std::string(text, size_t(length));
}

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(text, &length);
  std::string version(text, size_t(length));
  // The reported length may count the terminating NUL; keep the first line.
  if (const auto end = version.find_first_of(std::string("\n\0", 2)); end != std::string::npos) version.resize(end);
  return version;
}

}  // namespace tessera
