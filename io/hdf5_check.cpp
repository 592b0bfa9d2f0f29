// The HDF5 error stack as text, for tessera::Error messages; the library
// version and the switch that keeps HDF5 quiet at exit (io/hdf5_version.h).
#include "io/hdf5_check.h"

#include <sstream>

#include "io/hdf5_threads.h"
#include "io/hdf5_version.h"

namespace tessera {

std::string hdf5_library_version() {
  const io::Hdf5Serial serial;
  unsigned major = 0, minor = 0, release = 0;
  H5get_libversion(&major, &minor, &release);
  return "HDF5 " + std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release);
}

void skip_hdf5_shutdown_at_exit() {
  H5dont_atexit();
}

}  // namespace tessera

namespace tessera::detail {
namespace {

herr_t append_entry(unsigned depth, const H5E_error2_t* entry, void* context) {
  auto& text = *static_cast<std::ostringstream*>(context);
  char major[128] = {0}, minor[128] = {0};
  H5Eget_msg(entry->maj_num, nullptr, major, sizeof major);
  H5Eget_msg(entry->min_num, nullptr, minor, sizeof minor);
  if (depth > 0) text << "; ";
  text << "#" << depth << " " << (entry->func_name ? entry->func_name : "?") << ": " << (entry->desc ? entry->desc : "")
       << " (" << major << ": " << minor << ")";
  return 0;
}

}  // namespace

std::string hdf5_error_stack() {
  const io::Hdf5Serial serial;
  std::ostringstream text;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, append_entry, &text);
  H5Eclear2(H5E_DEFAULT);
  const std::string result = text.str();
  return result.empty() ? std::string("HDF5 call failed") : result;
}

}  // namespace tessera::detail
