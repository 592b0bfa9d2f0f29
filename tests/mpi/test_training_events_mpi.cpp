// TrainingEvents' step boundary under mpiexec (2 and 4 ranks): each rank's
// components give flags only that rank knows (a "signal" on one rank chosen
// at random, each rank's own number, a clock that only rank 0 reads), and
// every rank must receive their maximum over the world, make the same
// decisions, and stop at the same step with the same request, including a
// stop asked on one rank while a save was written (round 2).
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/context.h"
#include "io/training_events.h"
#include "tests/mpi/mpi_test.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

// Asks to stop when any rank's local flag (set by the test) is up, naming
// the highest rank that raised it, as the preemption component does.
class LocalStop : public io::TrainingComponent {
 public:
  explicit LocalStop(int rank) : rank_(rank) {}
  int raised = 0;  // this rank's "signal" for the next round
  std::vector<std::vector<int32_t>> agreed;

  void boundary_flags(const io::BoundaryRound&, std::vector<int32_t>& flags) override {
    flags.push_back(raised);
    flags.push_back(raised ? rank_ : -1);
  }
  void on_boundary(const io::BoundaryRound&, std::span<const int32_t> values, io::BoundaryDecision& decision) override {
    agreed.emplace_back(values.begin(), values.end());
    if (values[0] != 0) decision.request_stop({"raised on rank " + std::to_string(values[1]), values[0]});
  }

 private:
  int rank_;
};

// Each rank's own number and a save asked by rank 0's flag only; writes
// every save it is asked for, and raises `stop_during_save` on its rank's
// LocalStop while it does (a signal arriving during the save).
class RankSaver : public io::TrainingComponent {
 public:
  RankSaver(int rank, int size, LocalStop& stop) : rank_(rank), size_(size), stop_(stop) {}
  bool clock_due = false;         // this rank's clock says a save is due (only rank 0's counts)
  int raise_during_save = 0;      // the "signal" this rank raises while the save is written
  std::vector<int32_t> ranks_seen;  // the agreed maximum of the ranks' numbers, per round 1
  int saves = 0;

  void boundary_flags(const io::BoundaryRound& round, std::vector<int32_t>& flags) override {
    if (round.after_save) return;
    flags.push_back(rank_ == 0 && clock_due ? 1 : 0);
    flags.push_back(rank_);
    flags.push_back(size_ - 1 - rank_);
  }
  void on_boundary(const io::BoundaryRound& round, std::span<const int32_t> values,
                   io::BoundaryDecision& decision) override {
    if (round.after_save) {
      EXPECT_TRUE(values.empty());
      return;
    }
    EXPECT_EQ(values.size(), 3u);
    ranks_seen.push_back(values[1]);
    EXPECT_EQ(values[2], size_ - 1) << "the maximum of size - 1 - rank";
    if (values[0] != 0) decision.request_save();
  }
  void on_save(io::Save& save) override {
    ++saves;
    save.written = true;
    stop_.raised = raise_during_save;
  }

 private:
  int rank_, size_;
  LocalStop& stop_;
};

TEST(TrainingEventsMpi, EveryRankAgreesOnTheFlagsAndStopsAtTheSameStep) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();  // the same sequence on every rank
  std::unique_ptr<parallel::Communicator> world = testing::world();
  Context context(one_thread());
  const int rank = world->rank(), size = world->size();
  for (int trial = 0; trial < 6; ++trial) {
    io::TrainingEvents events(*world, context, Device::cpu());
    LocalStop& stop = events.add(std::make_unique<LocalStop>(rank));
    RankSaver& saver = events.add(std::make_unique<RankSaver>(rank, size, stop));
    const int64_t steps = 8;
    const int64_t stop_step = 1 + int64_t(rng() % steps);  // where one rank raises a signal
    const int chosen = int(rng() % uint64_t(size));
    const bool during_save = rng() % 2 == 0;  // raised while that step's save is written
    const int signal = 10 + int(rng() % 5);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": rank " + std::to_string(chosen) + " raises " +
                 std::to_string(signal) + " at step " + std::to_string(stop_step) +
                 (during_save ? " during its save" : ""));
    std::optional<io::StopRequest> stopped;
    int64_t step = 1;
    int expected_saves = 0;
    bool saved_at_stop_step = false;
    for (; step <= steps; ++step) {
      const bool last = step == steps;
      const bool clock = rng() % 3 == 0;
      saver.clock_due = clock;
      stop.raised = 0;
      saver.raise_during_save = 0;
      if (step == stop_step && rank == chosen) (during_save ? saver.raise_during_save : stop.raised) = signal;
      // The boundary saves when rank 0's clock says so (or at the last step); a
      // signal raised during a save stops the run only if that save was not final.
      const bool saves = clock || last || (step == stop_step && !during_save);
      if (saves) ++expected_saves;
      if (step == stop_step) saved_at_stop_step = saves;
      stopped = events.step_boundary(step, last);
      if (stopped) break;
    }
    const bool stops = stop_step < steps && (!during_save || saved_at_stop_step);
    EXPECT_EQ(stopped.has_value(), stops);
    if (stops) {
      EXPECT_EQ(step, stop_step) << "every rank stops at the step where one rank raised";
      EXPECT_EQ(stopped->signal, signal);
      EXPECT_EQ(stopped->why, "raised on rank " + std::to_string(chosen));
    }
    EXPECT_EQ(saver.saves, expected_saves);
    for (const int32_t seen : saver.ranks_seen) EXPECT_EQ(seen, size - 1);
    for (const std::vector<int32_t>& values : stop.agreed) EXPECT_EQ(values.size(), 2u);
  }
}

}  // namespace
}  // namespace tessera::testing
