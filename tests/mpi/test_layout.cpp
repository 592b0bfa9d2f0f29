// Layout: coordinates, axis sub-communicators and size validation.
//   - Under mpiexec (2 and 4 ranks), every grid the world can make, in every
//     axis order, against a reference that numbers the grid's points by
//     nested loops (slowest axis outermost); each axis communicator must hold
//     exactly the ranks that differ from this one only along that axis, in
//     coordinate order (checked by all-gathering world ranks over it).
//   - Worlds this machine cannot launch (6 and 8 ranks) through a recording
//     stand-in communicator that simulates every rank in this process.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <map>
#include <set>

#include "core/context.h"
#include "parallel/mpi_communicator.h"
#include "parallel/layout.h"
#include "tests/mpi/mpi_test.h"

namespace tessera::testing {
namespace {

using parallel::Communicator;
using parallel::Layout;
using parallel::LayoutSizes;

struct Coordinates {
  int tp, dp, pp;
  bool operator==(const Coordinates&) const = default;
};

// coordinates[rank], numbering the points with the fastest axis of `order`
// innermost.
std::vector<Coordinates> reference_layout(int tp, int dp, int pp, const std::string& order) {
  std::vector<std::string> axes;  // fastest first
  for (size_t begin = 0; begin <= order.size();) {
    const size_t dash = std::min(order.find('-', begin), order.size());
    axes.push_back(order.substr(begin, dash - begin));
    begin = dash + 1;
  }
  const std::map<std::string, int> size_of = {{"tp", tp}, {"dp", dp}, {"pp", pp}};
  std::vector<Coordinates> layout;
  std::map<std::string, int> at;
  for (at[axes[2]] = 0; at[axes[2]] < size_of.at(axes[2]); ++at[axes[2]])
    for (at[axes[1]] = 0; at[axes[1]] < size_of.at(axes[1]); ++at[axes[1]])
      for (at[axes[0]] = 0; at[axes[0]] < size_of.at(axes[0]); ++at[axes[0]])
        layout.push_back({at["tp"], at["dp"], at["pp"]});
  return layout;
}

// (A function, not designated initializers: GCC warns about the fields left out.)
LayoutSizes grid_sizes(int tp, int pp, std::string order = "tp-dp-pp", int dp = 0) {
  LayoutSizes sizes;
  sizes.tp = tp;
  sizes.pp = pp;
  sizes.dp = dp;
  sizes.order = std::move(order);
  return sizes;
}

const std::vector<std::string> kOrders = {"tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "dp-pp-tp", "pp-tp-dp", "pp-dp-tp"};

// The world ranks in `rank`'s group along `axis`, in coordinate order.
std::vector<int> reference_group(const std::vector<Coordinates>& layout, int rank, const std::string& axis) {
  std::vector<std::pair<int, int>> members;  // (coordinate along axis, world rank)
  const Coordinates me = layout[size_t(rank)];
  for (int r = 0; r < int(layout.size()); ++r) {
    const Coordinates c = layout[size_t(r)];
    if (axis == "tp" && c.dp == me.dp && c.pp == me.pp) members.push_back({c.tp, r});
    if (axis == "dp" && c.tp == me.tp && c.pp == me.pp) members.push_back({c.dp, r});
    if (axis == "pp" && c.tp == me.tp && c.dp == me.dp) members.push_back({c.pp, r});
  }
  std::sort(members.begin(), members.end());
  std::vector<int> ranks;
  for (const auto& m : members) ranks.push_back(m.second);
  return ranks;
}

TEST(Layout, EveryGridAndOrderOfTheWorld) {
  Context ctx;
  auto world = parallel::make_mpi_communicator(MPI_COMM_WORLD, "world");
  const int n = world->size(), me = world->rank();
  int grids = 0;
  for (int tp = 1; tp <= n; ++tp) {
    for (int pp = 1; pp <= n; ++pp) {
      if (n % (tp * pp) != 0) continue;
      const int dp = n / (tp * pp);
      for (const std::string& order : kOrders) {
        SCOPED_TRACE("tp " + std::to_string(tp) + " pp " + std::to_string(pp) + " order " + order);
        ++grids;
        Layout grid(*world, grid_sizes(tp, pp, order));
        const auto layout = reference_layout(tp, dp, pp, order);
        const Coordinates mine = layout[size_t(me)];
        EXPECT_EQ(grid.size("tp"), tp);
        EXPECT_EQ(grid.size("pp"), pp);
        EXPECT_EQ(grid.size("dp"), dp);
        EXPECT_EQ((Coordinates{grid.rank("tp"), grid.rank("dp"), grid.rank("pp")}), mine);
        for (int r = 0; r < n; ++r) {
          const Coordinates c = layout[size_t(r)];
          EXPECT_EQ(grid.world_rank_of({{"dp", c.dp}, {"pp", c.pp}, {"tp", c.tp}}), r);
        }
        EXPECT_EQ(&grid.world(), world.get());
        const std::array<std::pair<std::string, Communicator*>, 3> axes = {
            {{"tp", &grid.group("tp")}, {"dp", &grid.group("dp")}, {"pp", &grid.group("pp")}}};
        for (const auto& [axis, comm] : axes) {
          const std::vector<int> expected = reference_group(layout, me, axis);
          EXPECT_EQ(comm->name(), axis);
          EXPECT_EQ(comm->size(), int(expected.size()));
          EXPECT_EQ(comm->rank(), int(std::find(expected.begin(), expected.end(), me) - expected.begin()));
          // Every rank runs this all-gather on each axis, whatever it found above.
          Tensor gathered = ctx.empty(Shape{comm->size()}, DType::i32);
          comm->all_gather(ctx.from_vector(Shape{1}, std::vector<int32_t>{me}), gathered)->wait();
          EXPECT_EQ(gathered.to_vector<int32_t>(), std::vector<int32_t>(expected.begin(), expected.end())) << axis;
        }
        // Combined groups: the ranks that differ only along both axes, in world-rank order.
        for (const auto& [first, second] : std::vector<std::pair<std::string, std::string>>{
                 {"dp", "pp"}, {"tp", "pp"}, {"tp", "dp"}}) {
          std::vector<int32_t> expected;
          for (int r = 0; r < n; ++r) {
            const Coordinates c = layout[size_t(r)];
            const bool same_tp = c.tp == mine.tp, same_dp = c.dp == mine.dp, same_pp = c.pp == mine.pp;
            const bool kept = first == "dp" ? same_tp : (second == "pp" ? same_dp : same_pp);
            if (kept) expected.push_back(r);
          }
          Communicator& both = grid.group({first, second});
          EXPECT_EQ(&grid.group({second, first}), &both);  // made once
          Tensor gathered = ctx.empty(Shape{both.size()}, DType::i32);
          both.all_gather(ctx.from_vector(Shape{1}, std::vector<int32_t>{me}), gathered)->wait();
          EXPECT_EQ(gathered.to_vector<int32_t>(), expected) << first << "+" << second;
        }
        EXPECT_EQ(grid.describe(), "dp=" + std::to_string(dp) + " pp=" + std::to_string(pp) +
                                       " tp=" + std::to_string(tp) + " (order " + order + ")");
      }
    }
  }
  EXPECT_GE(grids, 6);
}

TEST(Layout, TensorParallelNeighboursByDefault) {
  auto world = parallel::make_mpi_communicator(MPI_COMM_WORLD, "world");
  const int n = world->size(), r = world->rank();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even world";
  Layout grid(*world, grid_sizes(2, 1));
  // The header's closed form: tp = r % 2, dp = r / 2 (pp = 1).
  EXPECT_EQ(grid.rank("tp"), r % 2);
  EXPECT_EQ(grid.rank("dp"), r / 2);
  EXPECT_EQ(grid.rank("pp"), 0);
  EXPECT_EQ(grid.size("dp"), n / 2);
  Layout data_first(*world, grid_sizes(2, 1, "dp-tp-pp"));
  EXPECT_EQ(data_first.rank("dp"), r % (n / 2));
  EXPECT_EQ(data_first.rank("tp"), r / (n / 2));
}

TEST(Layout, SizesThatDoNotFitTheWorldAreRejectedByFlag) {
  auto world = parallel::make_mpi_communicator(MPI_COMM_WORLD, "world");
  const int n = world->size();
  auto expect_error = [&](const LayoutSizes& sizes, std::vector<std::string> parts) {
    try {
      Layout grid(*world, sizes);
      ADD_FAILURE() << "no error; expected one mentioning " << parts[0];
    } catch (const Error& error) {
      const std::string what = error.what();
      for (const auto& part : parts) EXPECT_NE(what.find(part), std::string::npos) << part << " | " << what;
    }
  };
  const std::string ranks = std::to_string(n) + (n == 1 ? " rank" : " ranks");
  expect_error(grid_sizes(2 * n, 1),
               {ranks + " cannot make --tensor-parallel " + std::to_string(2 * n), "multiple of tp = "});
  expect_error(grid_sizes(1, 3 * n), {ranks + " cannot make --pipeline-parallel " + std::to_string(3 * n)});
  expect_error(grid_sizes(2 * n, 2), {"--tensor-parallel " + std::to_string(2 * n) + " × --pipeline-parallel 2"});
  expect_error(grid_sizes(0, 1), {"--tensor-parallel 0 must be at least 1"});
  expect_error(grid_sizes(1, -1), {"--pipeline-parallel -1"});
  expect_error(grid_sizes(1, 1, "tp-dp-pp", n + 1),
               {"data-parallel size " + std::to_string(n + 1), "the world has " + std::to_string(n)});
  for (const std::string order : {"tp-tp-pp", "tp-dp-pp-tp", "tensor-dp-pp", ""})
    expect_error(grid_sizes(1, 1, order), {"order '" + order + "'", "tp, cp, ep, dp, pp once each"});
  // An axis of size 1 may be left out of the order; one that is larger may not.
  expect_error(grid_sizes(1, 1, "tp-pp"), {"--rank-order 'tp-pp' leaves out dp, whose size is " + std::to_string(n)});
  // A failed layout makes no sub-communicator: the world is still in step.
  EXPECT_EQ(world->sequence(), 0u);
  EXPECT_EQ(Layout(*world, grid_sizes(1, 1, "dp")).size("dp"), n);
}

// ---------------------------------------------------------------------------
// Simulated worlds: a stand-in communicator that records how it is split.

struct SplitRecord {
  int color, key;
};

class RecordingCommunicator final : public Communicator {
 public:
  RecordingCommunicator(int rank, int size, std::string name, std::map<std::string, std::vector<SplitRecord>>* log)
      : rank_(rank), size_(size), name_(std::move(name)), log_(log) {}
  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  uint64_t sequence() const override { return 0; }
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    (*log_)[name].push_back({color, key});
    return std::make_unique<RecordingCommunicator>(-1, -1, name, log_);
  }

 private:
  parallel::CommHandle issue_all_reduce(Tensor&, parallel::ReduceOp) override { return unused(); }
  parallel::CommHandle issue_reduce_scatter(const Tensor&, Tensor&, parallel::ReduceOp) override { return unused(); }
  parallel::CommHandle issue_all_gather(const Tensor&, Tensor&) override { return unused(); }
  parallel::CommHandle issue_broadcast(Tensor&, int) override { return unused(); }
  parallel::CommHandle issue_send(const Tensor&, int) override { return unused(); }
  parallel::CommHandle issue_recv(Tensor&, int) override { return unused(); }
  parallel::CommHandle issue_send_recv(const std::vector<parallel::P2POp>&) override { return unused(); }
  void issue_barrier() override { unused(); }
  static parallel::CommHandle unused() { TESSERA_THROW("the recording communicator only records splits"); }
  int rank_, size_;
  std::string name_;
  std::map<std::string, std::vector<SplitRecord>>* log_;
};

TEST(LayoutSimulated, EightRanksTwoByTwoByTwo) {
  for (const std::string& order : kOrders) {
    SCOPED_TRACE(order);
    const auto layout = reference_layout(2, 2, 2, order);
    std::map<std::string, std::vector<SplitRecord>> log;  // per axis, indexed by world rank
    for (int r = 0; r < 8; ++r) {
      RecordingCommunicator world(r, 8, "world", &log);
      Layout grid(world, grid_sizes(2, 2, order));
      EXPECT_EQ((Coordinates{grid.rank("tp"), grid.rank("dp"), grid.rank("pp")}), layout[size_t(r)]) << "rank " << r;
      if (order == "tp-dp-pp") {  // the header's example
        EXPECT_EQ(grid.rank("tp"), r % 2);
        EXPECT_EQ(grid.rank("dp"), (r / 2) % 2);
        EXPECT_EQ(grid.rank("pp"), r / 4);
      }
    }
    // MPI_Comm_split semantics: equal colours make a group, ordered by key.
    for (const std::string axis : {"tp", "dp", "pp"}) {
      const auto& records = log[axis];
      ASSERT_EQ(records.size(), 8u);
      for (int r = 0; r < 8; ++r) {
        std::vector<std::pair<int, int>> group;  // (key, rank)
        for (int q = 0; q < 8; ++q)
          if (records[size_t(q)].color == records[size_t(r)].color) group.push_back({records[size_t(q)].key, q});
        std::sort(group.begin(), group.end());
        std::vector<int> members;
        for (const auto& g : group) members.push_back(g.second);
        EXPECT_EQ(members, reference_group(layout, r, axis)) << axis << " group of rank " << r;
        EXPECT_EQ(std::set<int>(members.begin(), members.end()).size(), members.size());
      }
    }
  }
}

// Sixteen ranks over tp 2 × cp 2 × dp 2 × pp 2 in two orders: each rank's
// coordinates against nested loops over the order, and the cp group and the
// dp+cp group (what context parallelism reduces gradients over) against the
// ranks that share the other coordinates.
TEST(LayoutSimulated, SixteenRanksWithContextParallelismAndCombinedGroups) {
  for (const std::string& order : {std::string("tp-cp-dp-pp"), std::string("cp-pp-tp-dp")}) {
    SCOPED_TRACE(order);
    std::vector<std::string> axes;  // fastest first
    for (size_t begin = 0; begin <= order.size();) {
      const size_t dash = std::min(order.find('-', begin), order.size());
      axes.push_back(order.substr(begin, dash - begin));
      begin = dash + 1;
    }
    std::vector<std::map<std::string, int>> expected(16);  // coordinates by world rank
    for (int r = 0; r < 16; ++r)
      for (size_t a = 0; a < axes.size(); ++a) expected[size_t(r)][axes[a]] = (r >> a) & 1;
    std::map<std::string, std::vector<SplitRecord>> log;
    for (int r = 0; r < 16; ++r) {
      RecordingCommunicator world(r, 16, "world", &log);
      LayoutSizes sizes;
      sizes.tp = sizes.cp = sizes.pp = 2;
      sizes.order = order;
      Layout layout(world, sizes);
      EXPECT_EQ(layout.size("dp"), 2);
      EXPECT_EQ(layout.size("ep"), 1);
      for (const std::string& axis : axes) EXPECT_EQ(layout.rank(axis), expected[size_t(r)][axis]) << r << axis;
      layout.group({"dp", "cp"});
      EXPECT_EQ(layout.describe(), "dp=2 pp=2 tp=2 cp=2 (order " + order + ")");
    }
    const auto members = [&](const std::string& name, int r) {
      std::vector<std::pair<int, int>> group;  // (key, rank)
      const auto& records = log[name];
      for (int q = 0; q < 16; ++q)
        if (records[size_t(q)].color == records[size_t(r)].color) group.push_back({records[size_t(q)].key, q});
      std::sort(group.begin(), group.end());
      std::vector<int> ranks;
      for (const auto& g : group) ranks.push_back(g.second);
      return ranks;
    };
    ASSERT_EQ(log["cp"].size(), 16u);
    ASSERT_EQ(log["cp+dp"].size(), 16u);
    for (int r = 0; r < 16; ++r) {
      std::vector<int> cp, dp_cp;
      for (int q = 0; q < 16; ++q) {
        const auto& a = expected[size_t(r)];
        const auto& b = expected[size_t(q)];
        if (a.at("tp") == b.at("tp") && a.at("pp") == b.at("pp")) {
          dp_cp.push_back(q);
          if (a.at("dp") == b.at("dp")) cp.push_back(q);
        }
      }
      std::sort(cp.begin(), cp.end(), [&](int x, int y) { return expected[size_t(x)]["cp"] < expected[size_t(y)]["cp"]; });
      EXPECT_EQ(members("cp", r), cp) << "rank " << r;
      EXPECT_EQ(members("cp+dp", r), dp_cp) << "rank " << r;
    }
  }
}

// The group that averages gradients is the one the parameters name: dp and
// cp by default (their combined group; dp's own where cp is 1), dp alone for
// parameters that say so; parameters that disagree are refused by name.
TEST(LayoutSimulated, GradientGroupIsTheOneTheParametersName) {
  std::map<std::string, std::vector<SplitRecord>> log;
  RecordingCommunicator world(5, 16, "world", &log);
  LayoutSizes sizes;
  sizes.tp = sizes.cp = sizes.pp = 2;
  Layout layout(world, sizes);
  nn::Parameter first, second;
  first.name = "blocks.0.attn.qkv.weight";
  second.name = "blocks.0.mlp.fc.weight";
  EXPECT_EQ(first.gradient_axes, (std::vector<std::string>{"dp", "cp", "ep"}));
  const std::vector<nn::Parameter*> both = {&first, &second};
  Communicator& replicas = parallel::gradient_group(layout, both);
  EXPECT_EQ(&replicas, &layout.group({"dp", "cp"}));
  EXPECT_EQ(replicas.name(), "cp+dp");
  first.gradient_axes = second.gradient_axes = {"dp"};
  EXPECT_EQ(&parallel::gradient_group(layout, both), &layout.group("dp"));
  second.gradient_axes = {"dp", "cp"};
  try {
    parallel::gradient_group(layout, both);
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("parameter 'blocks.0.mlp.fc.weight' has its gradient averaged over {dp, "
                                             "cp} and 'blocks.0.attn.qkv.weight' over {dp}"),
              std::string::npos)
        << error.what();
  }
  Layout no_context(world, grid_sizes(2, 2));  // cp 1: dp's own group, no other made
  const size_t splits_before = log["cp+dp"].size();
  first.gradient_axes = {"dp", "cp"};
  EXPECT_EQ(&parallel::gradient_group(no_context, both), &no_context.group("dp"));
  EXPECT_EQ(log["cp+dp"].size(), splits_before);
}

// Under expert parallelism a replica's parameters split by their groups:
// dense ones over dp, cp and ep, experts over dp and cp, widest first
// whatever order they come in, each keeping its parameters' order, the
// widest being the replicas; where ep is 1 the two are one group; a mix
// whose axes do not nest is refused naming two parameters and their axes.
TEST(LayoutSimulated, GradientGroupsSplitExpertsFromDenseParameters) {
  std::map<std::string, std::vector<SplitRecord>> log;
  RecordingCommunicator world(5, 16, "world", &log);
  LayoutSizes sizes;
  sizes.cp = sizes.ep = 2;
  Layout layout(world, sizes);  // dp 4
  nn::Parameter expert, router, expert_bias, head;
  expert.name = "blocks.0.mlp.experts.3.fc.weight";
  router.name = "blocks.0.mlp.router.weight";
  expert_bias.name = "blocks.0.mlp.experts.3.proj.weight";
  head.name = "lm_head.weight";
  expert.gradient_axes = expert_bias.gradient_axes = {"dp", "cp"};
  const std::vector<nn::Parameter*> mixed = {&expert, &router, &expert_bias, &head};
  const parallel::GradientGroups groups = parallel::gradient_groups(layout, mixed);
  ASSERT_EQ(groups.groups.size(), 2u);
  EXPECT_EQ(groups.groups[0].axes, (std::vector<std::string>{"cp", "ep", "dp"}));
  EXPECT_EQ(groups.groups[0].communicator, &layout.group({"dp", "cp", "ep"}));
  EXPECT_EQ(groups.groups[0].parameters, (std::vector<nn::Parameter*>{&router, &head}));
  EXPECT_EQ(groups.groups[1].communicator, &layout.group({"dp", "cp"}));
  EXPECT_EQ(groups.groups[1].parameters, (std::vector<nn::Parameter*>{&expert, &expert_bias}));
  EXPECT_EQ(groups.replicas, groups.groups[0].communicator);

  LayoutSizes no_experts;
  no_experts.cp = 2;
  Layout dense(world, no_experts);  // ep 1: an expert's axes are a dense parameter's
  const parallel::GradientGroups one = parallel::gradient_groups(dense, mixed);
  ASSERT_EQ(one.groups.size(), 1u);
  EXPECT_EQ(one.groups[0].parameters, mixed);
  EXPECT_EQ(one.replicas, &dense.group({"dp", "cp"}));

  expert.gradient_axes = {"ep"};  // neither a part of {dp, cp} nor holding it
  expert_bias.gradient_axes = {"dp", "cp", "ep"};
  router.gradient_axes = head.gradient_axes = {"dp", "cp"};
  try {
    parallel::gradient_groups(layout, mixed);
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what())
                  .find("parameter 'blocks.0.mlp.experts.3.fc.weight' has its gradient averaged "
                        "over {ep} and 'blocks.0.mlp.router.weight' over {cp, dp}; a replica's "
                        "gradient groups must nest"),
              std::string::npos)
        << error.what();
  }
}

TEST(LayoutSimulated, SixRanksCannotMakeTensorParallelFour) {
  std::map<std::string, std::vector<SplitRecord>> log;
  RecordingCommunicator world(0, 6, "world", &log);
  try {
    Layout grid(world, grid_sizes(4, 1));
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what())
                  .find("6 ranks cannot make --tensor-parallel 4: the world size must be a "
                        "multiple of tp = 4"),
              std::string::npos)
        << error.what();
  }
  EXPECT_TRUE(log.empty());
  Layout fits(world, grid_sizes(3, 1));
  EXPECT_EQ(fits.size("dp"), 2);
}

}  // namespace
}  // namespace tessera::testing
