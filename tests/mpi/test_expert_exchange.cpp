// parallel::ExpertExchange under a real mpiexec (2 and 4 ranks with the other
// MPI tests, 3 by itself): every rank draws every rank's slots from the
// shared test seed (12 experts; random rows per expert, an expert nobody
// chose, a rank whose tokens all go elsewhere), so each knows what must
// arrive. dispatch delivers each local expert's rows from every source rank
// in rank order, contiguous per expert; combine returns them to their slots;
// an "expert" that scales its rows by (1 + its global index) between the two
// gives, on every rank, its slots scaled as a single process would; a
// dispatch with nothing to send works; E not divisible by the ranks is refused.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "core/context.h"
#include "parallel/expert_exchange.h"
#include "tests/mpi/mpi_test.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

constexpr int64_t kExperts = 12, kWidth = 5;

// rows[s][e]: the rows rank s sends to expert e (each kWidth values).
struct Slots {
  std::vector<std::vector<std::vector<std::vector<double>>>> rows;
};

Slots random_slots(int ranks, std::mt19937_64& rng) {
  Slots s;
  const int64_t unused = int64_t(rng() % kExperts);
  const int elsewhere = int(rng() % uint64_t(ranks));  // this rank's experts get none of its own tokens
  const int64_t local = kExperts / ranks;
  s.rows.resize(size_t(ranks));
  for (int r = 0; r < ranks; ++r)
    for (int64_t e = 0; e < kExperts; ++e) {
      int64_t count = int64_t(rng() % 4);
      if (e == unused || (r == elsewhere && e / local == r)) count = 0;
      std::vector<std::vector<double>> rows;
      for (int64_t i = 0; i < count; ++i) {
        std::vector<double> row(static_cast<size_t>(kWidth));
        for (double& v : row) v = std::uniform_real_distribution<double>(-2.0, 2.0)(rng);
        rows.push_back(round_to(DType::f32, row));
      }
      s.rows[size_t(r)].push_back(rows);
    }
  return s;
}

struct Local {
  Tensor slots;
  std::vector<int64_t> offsets;
  std::vector<double> flat;
};
Local slots_of(Context& ctx, const Slots& s, int rank) {
  Local l;
  l.offsets.push_back(0);
  for (const auto& rows : s.rows[size_t(rank)]) {
    for (const auto& row : rows) l.flat.insert(l.flat.end(), row.begin(), row.end());
    l.offsets.push_back(l.offsets.back() + int64_t(rows.size()));
  }
  l.slots = ctx.from_doubles(Shape{l.offsets.back(), kWidth}, DType::f32, l.flat);
  return l;
}

TEST(ExpertExchange, DispatchGroupsEachExpertsRowsAndCombineReturnsThem) {
  TESSERA_SEED_TRACE();
  auto comm = world();
  Context ctx;
  auto rng = make_rng();
  const int ranks = comm->size(), me = comm->rank();
  if (kExperts % ranks != 0) GTEST_SKIP() << kExperts << " experts do not split over " << ranks << " ranks";
  parallel::ExpertExchange exchange(*comm, kExperts);
  const int64_t local = exchange.local_experts();
  EXPECT_EQ(exchange.first_expert(), me * local);
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const Slots s = random_slots(ranks, rng);
    const Local mine = slots_of(ctx, s, me);
    const Tensor rows = exchange.dispatch(mine.slots, mine.offsets);
    // Expected: for each local expert, every source's rows in rank order.
    std::vector<double> expected;
    std::vector<int64_t> offsets = {0};
    for (int64_t l = 0; l < local; ++l) {
      for (int q = 0; q < ranks; ++q)
        for (const auto& row : s.rows[size_t(q)][size_t(me * local + l)]) {
          expected.insert(expected.end(), row.begin(), row.end());
        }
      offsets.push_back(int64_t(expected.size()) / kWidth);
    }
    EXPECT_EQ(exchange.local_offsets(), offsets);
    EXPECT_TRUE(all_close(rows, expected, Tolerance{0, 0})) << "dispatched rows";
    // The experts scale their rows by (1 + global expert index); combine returns them.
    std::vector<double> scaled = rows.to_doubles();
    for (int64_t l = 0; l < local; ++l)
      for (int64_t i = offsets[size_t(l)] * kWidth; i < offsets[size_t(l + 1)] * kWidth; ++i)
        scaled[size_t(i)] *= double(1 + me * local + l);
    const Tensor back = exchange.combine(ctx.from_doubles(rows.shape(), DType::f32, scaled));
    std::vector<double> returned;
    for (int64_t e = 0; e < kExperts; ++e)
      for (const auto& row : s.rows[size_t(me)][size_t(e)])
        for (const double v : row) returned.push_back(v * double(1 + e));
    EXPECT_TRUE(all_close(back, returned, Tolerance{1e-6, 0})) << "combined rows";
  }
}

// With a trace (the group's events) each dispatch and combine is one event
// of its name, inside the clock's reading before and after the call, and
// results unchanged; without one nothing is recorded.
TEST(ExpertExchange, RecordsEachDispatchAndCombineForATrace) {
  TESSERA_SEED_TRACE();
  auto comm = world();
  Context ctx;
  auto rng = make_rng();
  const int ranks = comm->size(), me = comm->rank();
  if (kExperts % ranks != 0) GTEST_SKIP() << kExperts << " experts do not split over " << ranks << " ranks";
  struct Event {
    std::string name, category;
    int64_t start, end;
  };
  std::vector<Event> events;
  int64_t ticks = 0;
  parallel::ExpertExchange exchange(*comm, kExperts);
  const Slots s = random_slots(ranks, rng);
  const Local mine = slots_of(ctx, s, me);
  const Tensor untraced = exchange.combine(exchange.dispatch(mine.slots, mine.offsets));
  comm->set_events(parallel::GroupEvents{
      [&ticks] { return ++ticks; },
      [&events](const std::string& name, const std::string& category, int64_t start, int64_t end) {
        events.push_back({name, category, start, end});
      }});
  const int64_t before = ++ticks;
  const Tensor traced = exchange.combine(exchange.dispatch(mine.slots, mine.offsets));
  const int64_t after = ++ticks;
  comm->set_events({});
  exchange.combine(exchange.dispatch(mine.slots, mine.offsets));
  EXPECT_TRUE(all_close(traced, untraced.to_doubles(), Tolerance{0, 0}));
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].name, "expert dispatch");
  EXPECT_EQ(events[1].name, "expert combine");
  for (const Event& e : events) {
    EXPECT_EQ(e.category, "comm");
    EXPECT_LT(before, e.start);
    EXPECT_LT(e.start, e.end);
    EXPECT_LT(e.end, after);
  }
  EXPECT_LE(events[0].end, events[1].start);
}

TEST(ExpertExchange, ExpertsThatDoNotSplitOverTheRanksAreRefused) {
  auto comm = world();
  try {
    parallel::ExpertExchange exchange(*comm, 2 * comm->size() + 1);
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("does not split over --expert-model-parallel-size"), std::string::npos)
        << error.what();
  }
}

}  // namespace
}  // namespace tessera::testing
