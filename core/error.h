// Errors: one exception type, tessera::Error, that says which library failed
// (tessera itself, CUDA, cuBLAS, cuDNN, NCCL, MPI, HDF5), its code, the
// statement, file:line, the device and the MPI rank. Library code throws and
// never exits; only a program's main() catches (see apps/).
//
//   TESSERA_CHECK(cond, "what went wrong: ", value, "; what to do")   user errors
//   TESSERA_CHECK_ON(device, cond, ...)                               same, naming a device
//   TESSERA_THROW(...)                                                unconditional
// The CUDA, cuBLAS, cuDNN, NCCL, MPI and HDF5 check macros live beside the code
// that includes those libraries (core/cuda/cuda_check.h, parallel/, io/) and
// all end in tessera::throw_library_error().
#pragma once

#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

#include "core/device.h"

namespace tessera {

struct ErrorSite {
  std::string_view library;    // "tessera", "CUDA", "cuBLAS", "cuDNN", "NCCL", "MPI", "HDF5"
  long long code = 0;          // the library's status code (0 for tessera)
  std::string_view code_name;  // e.g. "cudaErrorMemoryAllocation"
  std::string_view statement;  // the failing expression
  std::string_view file;
  int line = 0;
  std::optional<Device> device;
};

class Error : public std::runtime_error {
 public:
  Error(const ErrorSite& site, std::string message);

  const std::string& library() const { return library_; }
  long long code() const { return code_; }
  const std::string& message() const { return message_; }  // without the context lines
  const std::string& file() const { return file_; }
  int line() const { return line_; }
  const std::string& statement() const { return statement_; }
  std::optional<Device> device() const { return device_; }
  int rank() const { return rank_; }  // -1 when not started by an MPI launcher

 private:
  std::string library_, message_, file_, statement_;
  long long code_;
  int line_;
  std::optional<Device> device_;
  int rank_;
};

// The MPI rank of this process as its launcher announced it (Open MPI, PMIx,
// MPICH/Hydra, Slurm), or -1. Read from the environment, so it is known even
// before MPI_Init and in code that knows nothing of MPI.
int launcher_rank();

[[noreturn]] void throw_error(const ErrorSite& site, std::string message);

namespace detail {
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
}  // namespace detail

}  // namespace tessera

#define TESSERA_THROW(...)                                                                   \
  ::tessera::throw_error(::tessera::ErrorSite{"tessera", 0, {}, {}, __FILE__, __LINE__, {}}, \
                         ::tessera::detail::concat(__VA_ARGS__))

#define TESSERA_CHECK(cond, ...)                                                                    \
  do {                                                                                              \
    if (!(cond)) [[unlikely]]                                                                       \
      ::tessera::throw_error(::tessera::ErrorSite{"tessera", 0, {}, #cond, __FILE__, __LINE__, {}}, \
                             ::tessera::detail::concat(__VA_ARGS__));                               \
  } while (0)

#define TESSERA_CHECK_ON(device, cond, ...)                                                             \
  do {                                                                                                  \
    if (!(cond)) [[unlikely]]                                                                           \
      ::tessera::throw_error(::tessera::ErrorSite{"tessera", 0, {}, #cond, __FILE__, __LINE__, device}, \
                             ::tessera::detail::concat(__VA_ARGS__));                                   \
  } while (0)
