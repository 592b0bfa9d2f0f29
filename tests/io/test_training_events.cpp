// TrainingEvents (io/training_events.h) in one process: every event reaches
// the components in registration order (the log each keeps is compared with
// one built from the registration order), figures added to a step's record
// reach the components after, an evaluation announced during step end
// reaches every component there, each component gets its own flags back
// from the agreement, and the step boundary's protocol: a stop saves first
// (a final save), a requested save that was written is followed by a second
// round in which a stop uses that checkpoint, nothing happens to the run at
// its last step but the final save, the first stop asked wins, and the
// components go away last registered first. (Agreement over several ranks:
// tests/mpi/test_training_events_mpi.cpp.)
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/context.h"
#include "io/training_events.h"
#include "parallel/local_communicator.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using Log = std::vector<std::string>;

// Notes every event it receives as "<name>:<event>"; what it does at the
// boundary and at a save is given by the test.
class Recorder : public io::TrainingComponent {
 public:
  Recorder(std::string name, Log& log) : name_(std::move(name)), log_(log) {}
  ~Recorder() override { note("destroyed"); }

  std::function<void(io::StepEnd&)> step_end;
  std::function<std::vector<int32_t>(const io::BoundaryRound&)> flags;
  std::function<void(const io::BoundaryRound&, std::span<const int32_t>, io::BoundaryDecision&)> boundary;
  bool writes_checkpoints = false;
  std::vector<io::Save> saves;
  std::vector<io::Stop> stops;

  void on_run_start(const io::RunStart& e) override { note("run_start " + std::to_string(e.start_step)); }
  void on_step_begin(const io::StepBegin& e) override { note("step_begin " + std::to_string(e.step)); }
  void on_step_end(io::StepEnd& e) override {
    note("step_end " + std::to_string(e.step) + " extras " + std::to_string(e.record.extra.size()));
    if (step_end) step_end(e);
  }
  void on_evaluation(const io::EvalEnd& e) override { note("evaluation " + std::to_string(e.record.step)); }
  void boundary_flags(const io::BoundaryRound& round, std::vector<int32_t>& out) override {
    if (!flags) return;
    for (const int32_t value : flags(round)) out.push_back(value);
  }
  void on_boundary(const io::BoundaryRound& round, std::span<const int32_t> agreed,
                   io::BoundaryDecision& decision) override {
    note(std::string(round.after_save ? "round 2" : "round 1") + " at " + std::to_string(round.step));
    if (boundary) boundary(round, agreed, decision);
  }
  void on_save(io::Save& save) override {
    note(std::string("save") + (save.final ? " final" : ""));
    saves.push_back(save);
    if (writes_checkpoints) save.written = true;
  }
  void on_stop(const io::Stop& stop) override {
    note("stop: " + stop.request.why);
    stops.push_back(stop);
  }
  void on_run_end(const io::RunEnd& e) override { note("run_end " + e.stop_reason); }

 private:
  void note(const std::string& what) { log_.push_back(name_ + ":" + what); }
  std::string name_;
  Log& log_;
};

// "a:x", "b:x", "c:x" for names {a, b, c}.
Log each(const std::vector<std::string>& names, const std::string& what) {
  Log out;
  for (const std::string& name : names) out.push_back(name + ":" + what);
  return out;
}

Log joined(std::initializer_list<Log> parts) {
  Log out;
  for (const Log& part : parts) out.insert(out.end(), part.begin(), part.end());
  return out;
}

struct Fixture {
  Context context;
  std::unique_ptr<parallel::Communicator> world = parallel::make_local_communicator("world");
  Log log;
  std::optional<io::TrainingEvents> events;
  std::vector<Recorder*> recorders;

  explicit Fixture(const std::vector<std::string>& names) {
    events.emplace(*world, context, Device::cpu());
    for (const std::string& name : names) recorders.push_back(&events->add(std::make_unique<Recorder>(name, log)));
  }
};

TEST(TrainingEvents, EveryEventReachesTheComponentsInRegistrationOrder) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  std::vector<std::string> names;
  for (int i = 0; i < 2 + int(rng() % 5); ++i) names.push_back(std::to_string(i).insert(0, "component "));
  Fixture f(names);
  // Each component adds one figure: the next sees one more.
  for (Recorder* r : f.recorders) r->step_end = [](io::StepEnd& e) { e.record.extra.emplace_back("figure", 1.0); };

  f.events->run_start({4, 10});
  f.events->step_begin({5});
  io::StepRecord record;
  io::StepEnd end{5, false, record, 0.1, 0.0, 0.0};
  f.events->step_end(end);
  f.events->run_end({5, "why"});
  Log expected = joined({each(names, "run_start 4"), each(names, "step_begin 5")});
  for (size_t i = 0; i < names.size(); ++i) expected.push_back(names[i] + ":step_end 5 extras " + std::to_string(i));
  expected = joined({expected, each(names, "run_end why")});
  EXPECT_EQ(f.log, expected);
  EXPECT_EQ(record.extra.size(), names.size());

  f.log.clear();
  f.events.reset();
  Log destroyed;
  for (auto name = names.rbegin(); name != names.rend(); ++name) destroyed.push_back(*name + ":destroyed");
  EXPECT_EQ(f.log, destroyed) << "the components go away last registered first";
}

TEST(TrainingEvents, AnEvaluationAnnouncedDuringStepEndReachesEveryComponentThere) {
  const std::vector<std::string> names = {"a", "evaluator", "c"};
  Fixture f(names);
  f.recorders[1]->step_end = [&](io::StepEnd& e) { f.events->evaluation({io::EvalRecord{e.step, 2.5}, 100, e.last}); };
  io::StepRecord record;
  io::StepEnd end{7, true, record, 0.1, 0.0, 0.0};
  f.events->step_end(end);
  EXPECT_EQ(f.log, joined({{"a:step_end 7 extras 0", "evaluator:step_end 7 extras 0"},
                           each(names, "evaluation 7"),
                           {"c:step_end 7 extras 0"}}));
}

TEST(TrainingEvents, EachComponentGetsItsOwnFlagsBack) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  Fixture f({"none", "two", "three", "one"});
  std::vector<std::vector<int32_t>> given(4), received(4);
  for (size_t i = 0; i < 4; ++i) {
    const size_t count = std::vector<size_t>{0, 2, 3, 1}[i];
    for (size_t k = 0; k < count; ++k) given[i].push_back(int32_t(rng() % 1000) - 500);
    f.recorders[i]->flags = [&given, i](const io::BoundaryRound&) { return given[i]; };
    f.recorders[i]->boundary = [&received, i](const io::BoundaryRound&, std::span<const int32_t> agreed,
                                              io::BoundaryDecision&) {
      received[i].assign(agreed.begin(), agreed.end());
    };
  }
  EXPECT_FALSE(f.events->step_boundary(3, false).has_value());
  EXPECT_EQ(received, given);
  EXPECT_EQ(f.log, each({"none", "two", "three", "one"}, "round 1 at 3")) << "nothing asked: one round, no save";
}

// One boundary: a component that asks for a save (in round 1) and writes it
// or not, and one that asks to stop in round 1 or 2.
struct BoundaryCase {
  int64_t step = 5;
  bool last = false;
  bool ask_save = false, written = false;
  int stop_round = 0;  // 0: no stop asked; 1 or 2: asked in that round
};

TEST(TrainingEvents, TheBoundarySavesBeforeAStopAndAStopDuringASaveUsesThatCheckpoint) {
  const std::vector<BoundaryCase> cases = {
      {5, false, true, true, 0},   // an interval save, written: round 2 finds nothing
      {5, false, true, true, 2},   // a signal during that save: it stops with that checkpoint
      {5, false, true, false, 2},  // nothing written (no --save): no round 2
      {5, false, false, true, 1},  // a stop: its save is final, no round 2
      {5, true, false, true, 1},   // the last step: the stop changes nothing, the save is final
      {5, true, true, true, 0},
  };
  for (const BoundaryCase& k : cases) {
    SCOPED_TRACE("save " + std::to_string(k.ask_save) + " written " + std::to_string(k.written) + " stop in round " +
                 std::to_string(k.stop_round) + (k.last ? " (last step)" : ""));
    Fixture f({"saver", "stopper"});
    Recorder& saver = *f.recorders[0];
    Recorder& stopper = *f.recorders[1];
    saver.writes_checkpoints = k.written;
    saver.boundary = [&](const io::BoundaryRound& round, std::span<const int32_t>, io::BoundaryDecision& decision) {
      if (k.ask_save && !round.after_save) decision.request_save();
    };
    stopper.boundary = [&](const io::BoundaryRound& round, std::span<const int32_t>, io::BoundaryDecision& decision) {
      if (k.stop_round == (round.after_save ? 2 : 1)) decision.request_stop({"asked", 15});
    };
    const std::optional<io::StopRequest> stop = f.events->step_boundary(k.step, k.last);

    const bool stops = k.stop_round != 0 && !k.last;
    const bool saves = k.last || k.ask_save || k.stop_round == 1;
    const bool final_save = k.last || k.stop_round == 1;
    const bool second_round = saves && !final_save && k.written;
    const bool stops_now = stops && (k.stop_round == 1 || second_round);
    Log expected = each({"saver", "stopper"}, "round 1 at 5");
    if (saves) expected = joined({expected, each({"saver", "stopper"}, final_save ? "save final" : "save")});
    if (second_round) expected = joined({expected, each({"saver", "stopper"}, "round 2 at 5")});
    if (stops_now) expected = joined({expected, each({"saver", "stopper"}, "stop: asked")});
    EXPECT_EQ(f.log, expected);
    EXPECT_EQ(stop.has_value(), stops_now);
    if (stop) {
      EXPECT_EQ(stop->why, "asked");
      EXPECT_EQ(stop->signal, 15);
      ASSERT_EQ(saver.stops.size(), 1u);
      EXPECT_EQ(saver.stops[0].step, 5);
      EXPECT_FALSE(saver.stops[0].error);
    }
    if (saves) {
      ASSERT_EQ(saver.saves.size(), 1u);
      EXPECT_EQ(saver.saves[0].step, 5);
    }
  }
}

TEST(TrainingEvents, TheFirstStopAskedWins) {
  Fixture f({"signal", "interval"});
  f.recorders[0]->boundary = [](const io::BoundaryRound&, std::span<const int32_t>, io::BoundaryDecision& decision) {
    decision.request_stop({"signal", 10});
  };
  f.recorders[1]->boundary = [](const io::BoundaryRound&, std::span<const int32_t>, io::BoundaryDecision& decision) {
    decision.request_stop({"interval", 0});
  };
  const std::optional<io::StopRequest> stop = f.events->step_boundary(2, false);
  ASSERT_TRUE(stop.has_value());
  EXPECT_EQ(stop->why, "signal");
  EXPECT_EQ(stop->signal, 10);
}

TEST(TrainingEvents, SaveAndStopOutsideABoundaryReachEveryComponent) {
  Fixture f({"a", "b"});
  f.recorders[1]->writes_checkpoints = true;
  io::Save save{0, true};
  f.events->save(save);
  EXPECT_TRUE(save.written);
  f.events->stop({3, {"error"}, true});
  EXPECT_EQ(f.log, joined({each({"a", "b"}, "save final"), each({"a", "b"}, "stop: error")}));
  EXPECT_TRUE(f.recorders[0]->stops.at(0).error);
}

}  // namespace
}  // namespace tessera::testing
