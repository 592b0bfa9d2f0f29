// HDF5 call checking: hdf5_checked(call, ...) returns the call's value when it
// is non-negative and otherwise throws tessera::Error carrying HDF5's own
// error stack (major/minor messages). The macro holds the HDF5 lock
// (io/hdf5_threads.h) over the call and the reading of its error stack, e.g.
//   const hid_t file = TESSERA_HDF5_CHECK(H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT));
#pragma once

#include <hdf5.h>

#include <string>
#include <string_view>

#include "core/error.h"
#include "io/hdf5_threads.h"

namespace tessera::detail {

// The current HDF5 error stack as text (and clears it).
std::string hdf5_error_stack();

template <typename T>
T hdf5_checked(T status, std::string_view statement, std::string_view file, int line) {
  if (status < 0) [[unlikely]]
    throw_error(ErrorSite{"HDF5", static_cast<long long>(status), {}, statement, file, line, {}}, hdf5_error_stack());
  return status;
}

}  // namespace tessera::detail

// The guard, a temporary of the full expression, lives until the check has
// read the error stack (or thrown).
#define TESSERA_HDF5_CHECK(expr) \
  ::tessera::detail::hdf5_checked((::tessera::io::Hdf5Serial(), (expr)), #expr, __FILE__, __LINE__)
