// TESSERA_MPI_CHECK on a real Open MPI (a singleton rank, no launcher
// needed): an invalid call throws with MPI's error text.
#include <gtest/gtest.h>

#include "parallel/library_versions.h"
#include "parallel/mpi_check.h"

namespace tessera::testing {
namespace {

TEST(MpiCheck, InvalidCallThrowsWithMpisText) {
  TESSERA_MPI_CHECK(MPI_Init(nullptr, nullptr));
  TESSERA_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  int size = 0;
  TESSERA_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  const int payload = 1;
  try {
    TESSERA_MPI_CHECK(MPI_Send(&payload, 1, MPI_INT, size + 5, 0, MPI_COMM_WORLD));  // no such rank
    ADD_FAILURE() << "no throw";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_EQ(error.library(), "MPI");
    EXPECT_NE(what.find("MPI_Send"), std::string::npos) << what;
    EXPECT_NE(what.find("rank"), std::string::npos) << what;  // "invalid rank"
  }
  EXPECT_NE(mpi_library_version().find("MPI"), std::string::npos);
  MPI_Finalize();
}

}  // namespace
}  // namespace tessera::testing
