// end_process() (core/process_end.h): the hook the program installs decides
// how the process ends, with what it is told; without one, or when the hook
// returns, the process exits with the code at once. Death tests: each case
// runs in a child process.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "core/process_end.h"

namespace tessera::testing {
namespace {

// Says what it was told, then exits with code + 1 (so the test sees the hook ended it).
void telling_hook(ProcessEnd how, int code) {
  std::fprintf(stderr, "hook: %s %d\n", process_end_name(how), code);
  std::_Exit(code + 1);
}

void returning_hook(ProcessEnd how, int) {
  std::fprintf(stderr, "hook returned after %s\n", process_end_name(how));
}

class ProcessEndTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
  void TearDown() override { set_process_end_hook(nullptr); }
};

TEST_F(ProcessEndTest, WithoutAHookTheProcessExitsWithTheCode) {
  set_process_end_hook(nullptr);
  EXPECT_EXIT(end_process(ProcessEnd::watchdog_thread, 7), ::testing::ExitedWithCode(7), "");
  EXPECT_EXIT(end_process(ProcessEnd::stalled_collective, 3), ::testing::ExitedWithCode(3), "");
}

TEST_F(ProcessEndTest, TheInstalledHookIsToldHowAndWithWhatCode) {
  EXPECT_EQ(set_process_end_hook(telling_hook), nullptr);
  EXPECT_EXIT(end_process(ProcessEnd::stalled_collective, 3), ::testing::ExitedWithCode(4),
              "hook: stalled_collective 3");
  EXPECT_EXIT(end_process(ProcessEnd::watchdog_thread, 1), ::testing::ExitedWithCode(2), "hook: watchdog_thread 1");
  EXPECT_EXIT(end_process(ProcessEnd::injected_crash, 137), ::testing::ExitedWithCode(138), "hook: injected_crash 137");
  EXPECT_EQ(set_process_end_hook(nullptr), telling_hook);
}

TEST_F(ProcessEndTest, AHookThatReturnsStillEndsTheProcess) {
  set_process_end_hook(returning_hook);
  EXPECT_EXIT(end_process(ProcessEnd::watchdog_thread, 5), ::testing::ExitedWithCode(5),
              "hook returned after watchdog_thread");
}

}  // namespace
}  // namespace tessera::testing
