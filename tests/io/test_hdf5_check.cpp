// TESSERA_HDF5_CHECK on a real HDF5 library: success passes values through,
// failures throw with HDF5's own error stack and the failing statement.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "io/hdf5_check.h"

namespace tessera::testing {
namespace {

TEST(Hdf5Check, MissingFileThrowsWithHdf5sMessage) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // no printing from the library itself
  try {
    TESSERA_HDF5_CHECK(H5Fopen("/nonexistent/tessera.h5", H5F_ACC_RDONLY, H5P_DEFAULT));
    FAIL() << "no throw";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_EQ(error.library(), "HDF5");
    EXPECT_NE(what.find("H5Fopen"), std::string::npos) << what;
    EXPECT_NE(what.find("unable to open file"), std::string::npos) << what;
    EXPECT_NE(what.find("test_hdf5_check.cpp"), std::string::npos) << what;
  }
}

// This binary, run again on the tests that open damaged checkpoints, ends
// without HDF5's "infinite loop closing library" (tests/support/test_support.cpp).
TEST(Hdf5Check, TestBinariesEndQuietlyAfterDamagedFiles) {
  const std::string command = "/proc/" + std::to_string(::getpid()) +
                              "/exe --gtest_filter='Writers/Checkpoint.DamagedMetadata*' 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) output.append(buffer, n);
  const int status = ::pclose(pipe);
  EXPECT_EQ(status, 0) << output;
  EXPECT_NE(output.find("[  PASSED  ] 2 tests"), std::string::npos) << output;
  EXPECT_EQ(output.find("infinite loop closing library"), std::string::npos) << output;
}

TEST(Hdf5Check, SuccessReturnsTheValue) {
  const auto path = std::filesystem::temp_directory_path() / ("tessera_hdf5_check_" + std::to_string(getpid()) + ".h5");
  const hid_t file = TESSERA_HDF5_CHECK(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  EXPECT_GE(file, 0);
  TESSERA_HDF5_CHECK(H5Fclose(file));
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace tessera::testing
