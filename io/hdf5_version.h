// The linked HDF5 library's version, for logs and `tessera --version`, in a
// header that does not need hdf5.h.
#pragma once

#include <string>

namespace tessera {

std::string hdf5_library_version();  // e.g. "HDF5 1.10.8"

}  // namespace tessera
