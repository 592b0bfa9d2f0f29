// The linked HDF5 library's version, for logs and `tessera --version`, and
// the switch that keeps HDF5 quiet at exit, in a header that does not need
// hdf5.h.
#pragma once

#include <string>

namespace tessera {

std::string hdf5_library_version();  // e.g. "HDF5 1.10.8"

// Stops HDF5 from closing its library at process exit. A file whose metadata
// is damaged cannot be closed (its cache entries never load), and HDF5's exit
// handler then prints "HDF5: infinite loop closing library" and a line of
// "FL,FL,..." after our own message. Programs call this first thing in main();
// the operating system closes the files.
void skip_hdf5_shutdown_at_exit();

}  // namespace tessera
