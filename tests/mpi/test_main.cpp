// main() of the MPI test binary: starts MPI (MpiEnv), gives every rank the
// same test seed (rank 0's, so each rank can generate every rank's inputs),
// lets only rank 0 print GoogleTest's normal output while every rank prints
// its own failures prefixed "[rank r/N]", and makes all ranks exit with the
// same code: non-zero when any rank failed.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>

#include "parallel/mpi_communicator.h"
#include "tests/mpi/mpi_test.h"

namespace tessera::testing {
namespace {

parallel::MpiEnv* the_env = nullptr;

// Prints this rank's failures with its rank, whatever rank 0 prints.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  RankFailurePrinter(int rank, int size)
      : prefix_("[rank " + std::to_string(rank) + "/" + std::to_string(size) + "] ") {}

  // (The test's name comes from OnTestStart: UnitTest::current_test_info()
  // would deadlock here, GoogleTest holds its lock while reporting a result.)
  void OnTestStart(const ::testing::TestInfo& info) override {
    test_ = std::string(info.test_suite_name()) + "." + info.name();
  }

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::string text = prefix_ + (result.file_name() ? result.file_name() : "?") + ":" +
                       std::to_string(result.line_number()) + ": failure in " + test_ + "\n";
    std::istringstream lines(result.message());
    for (std::string line; std::getline(lines, line);) text += prefix_ + line + "\n";
    std::fputs(text.c_str(), stdout);
    std::fflush(stdout);
  }

  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Failed()) return;
    std::fprintf(stdout, "%sFAILED %s.%s\n", prefix_.c_str(), info.test_suite_name(), info.name());
    std::fflush(stdout);
  }

 private:
  std::string prefix_;
  std::string test_ = "(outside any test)";
};

// Rank 0's TESSERA_TEST_SEED (or a fresh one) for every rank, set before any
// test reads it.
void share_test_seed(int rank) {
  unsigned long long seed = 0;
  if (rank == 0) {
    if (const char* text = std::getenv("TESSERA_TEST_SEED"); text && *text) {
      seed = std::strtoull(text, nullptr, 10);
    } else {
      std::random_device device;
      seed = (static_cast<unsigned long long>(device()) << 32) ^ device();
    }
  }
  MPI_Bcast(&seed, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
  setenv("TESSERA_TEST_SEED", std::to_string(seed).c_str(), 1);
}

}  // namespace

parallel::MpiEnv& mpi_env() {
  return *the_env;
}

std::unique_ptr<parallel::Communicator> world() {
  return parallel::make_mpi_communicator(MPI_COMM_WORLD, "world");
}

ContextOptions one_thread() {
  ContextOptions options;
  options.cpu_threads = 1;
  return options;
}

}  // namespace tessera::testing

int main(int argc, char** argv) {
  tessera::parallel::MpiEnv env;
  tessera::testing::the_env = &env;
  ::testing::InitGoogleTest(&argc, argv);
  tessera::testing::share_test_seed(env.world_rank());

  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (env.world_rank() != 0) delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new tessera::testing::RankFailurePrinter(env.world_rank(), env.world_size()));
  if (env.is_root())
    std::printf("MPI tests on %s\n", env.describe_layout().c_str());
  else
    env.describe_layout();  // collective

  const int failed_here = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int failed_anywhere = failed_here;
  MPI_Allreduce(&failed_here, &failed_anywhere, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (env.is_root() && failed_anywhere && !failed_here)
    std::printf("rank 0 passed, but another rank failed (see its [rank r/N] lines)\n");
  std::fflush(stdout);
  return failed_anywhere ? 1 : 0;
}
