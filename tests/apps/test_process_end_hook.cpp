// The program's process-end hook (apps/process_end.h), in child processes:
// an injected crash dies by SIGKILL (as the fault tests expect of a killed
// rank), a watchdog thread's end exits with its code at once, and a stalled
// collective outside MPI (nothing to abort) exits with its code too. Under
// mpirun, the fault tests see a stalled collective end every rank (MPI_Abort).
#include <gtest/gtest.h>

#include <csignal>

#include "apps/process_end.h"
#include "core/process_end.h"

namespace tessera::testing {
namespace {

class ProcessEndHook : public ::testing::Test {
 protected:
  void SetUp() override {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    app::install_process_end_hook();
  }
  void TearDown() override { set_process_end_hook(nullptr); }
};

TEST_F(ProcessEndHook, AnInjectedCrashDiesBySigkill) {
  EXPECT_EXIT(end_process(ProcessEnd::injected_crash, 137), ::testing::KilledBySignal(SIGKILL), "");
}

TEST_F(ProcessEndHook, AWatchdogThreadExitsWithItsCode) {
  EXPECT_EXIT(end_process(ProcessEnd::watchdog_thread, 1), ::testing::ExitedWithCode(1), "");
}

TEST_F(ProcessEndHook, AStalledCollectiveWithoutMpiExitsWithItsCode) {
  EXPECT_EXIT(end_process(ProcessEnd::stalled_collective, 3), ::testing::ExitedWithCode(3), "");
}

}  // namespace
}  // namespace tessera::testing
