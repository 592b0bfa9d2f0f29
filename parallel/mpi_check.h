// TESSERA_MPI_CHECK: throws tessera::Error with MPI's own error text when an
// MPI call does not return MPI_SUCCESS. MPI only returns errors once the
// communicator's error handler is MPI_ERRORS_RETURN (set by the MPI bootstrap);
// with the default handler MPI aborts inside the call.
#pragma once

#include <mpi.h>

#include <string>

#include "core/error.h"

namespace tessera::detail {

std::string mpi_error_text(int status);

}  // namespace tessera::detail

#define TESSERA_MPI_CHECK(expr)                                                                               \
  do {                                                                                                        \
    const int tessera_status_ = (expr);                                                                       \
    if (tessera_status_ != MPI_SUCCESS) [[unlikely]]                                                          \
      ::tessera::throw_error(::tessera::ErrorSite{"MPI", tessera_status_, {}, #expr, __FILE__, __LINE__, {}}, \
                             ::tessera::detail::mpi_error_text(tessera_status_));                             \
  } while (0)
