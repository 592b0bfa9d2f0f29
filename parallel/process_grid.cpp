// ProcessGrid: validates dp × pp × tp against the world size, places each
// rank on the grid by the order string (fastest-varying axis first), and
// splits the world into one sub-communicator per axis.
#include "parallel/process_grid.h"

#include <array>
#include <sstream>
#include <string_view>

#include "core/error.h"

namespace tessera::parallel {
namespace {

enum Axis { kTp = 0, kDp = 1, kPp = 2 };
constexpr std::array<std::string_view, 3> kAxisNames = {"tp", "dp", "pp"};

// "tp-dp-pp" → {kTp, kDp, kPp}: each axis exactly once, fastest first.
std::array<int, 3> parse_order(const std::string& order) {
  std::array<int, 3> axes{};
  std::array<bool, 3> seen{};
  std::string_view rest = order;
  int count = 0;
  while (true) {
    const size_t dash = rest.find('-');
    const std::string_view name = rest.substr(0, dash);
    int axis = -1;
    for (int a = 0; a < 3; ++a)
      if (name == kAxisNames[size_t(a)]) axis = a;
    TESSERA_CHECK(axis >= 0 && count < 3 && !seen[size_t(axis)], "process grid order '", order,
                  "' must name tp, dp and pp once each, fastest-varying first, separated by '-' (e.g. tp-dp-pp)");
    seen[size_t(axis)] = true;
    axes[size_t(count++)] = axis;
    if (dash == std::string_view::npos) break;
    rest = rest.substr(dash + 1);
  }
  TESSERA_CHECK(count == 3, "process grid order '", order,
                "' must name tp, dp and pp once each, fastest-varying first, separated by '-' (e.g. tp-dp-pp)");
  return axes;
}

}  // namespace

ProcessGrid::ProcessGrid(Communicator& world, const GridSizes& sizes) : world_(world), order_(sizes.order) {
  const int world_size = world.size();
  TESSERA_CHECK(sizes.tp >= 1, "--tensor-parallel ", sizes.tp, " must be at least 1");
  TESSERA_CHECK(sizes.pp >= 1, "--pipeline-parallel ", sizes.pp, " must be at least 1");
  TESSERA_CHECK(sizes.dp >= 0, "the data-parallel size ", sizes.dp,
                " must be at least 1 (or 0: the rest of the world)");
  const int64_t model = int64_t(sizes.tp) * sizes.pp;
  if (world_size % model != 0) {
    std::ostringstream why;
    why << world_size << (world_size == 1 ? " rank" : " ranks") << " cannot make ";
    if (sizes.pp == 1)
      why << "--tensor-parallel " << sizes.tp;
    else if (sizes.tp == 1)
      why << "--pipeline-parallel " << sizes.pp;
    else
      why << "--tensor-parallel " << sizes.tp << " × --pipeline-parallel " << sizes.pp;
    why << ": the world size must be a multiple of tp·pp = " << model
        << "; launch a multiple of that many ranks or choose sizes that divide " << world_size;
    TESSERA_THROW(why.str());
  }
  const int dp = int(world_size / model);
  TESSERA_CHECK(sizes.dp == 0 || sizes.dp == dp, "the data-parallel size ", sizes.dp, " × --tensor-parallel ", sizes.tp,
                " × --pipeline-parallel ", sizes.pp, " = ", int64_t(sizes.dp) * model, " ranks, but the world has ",
                world_size, "; leave the data-parallel size out (it is the world size / (tp·pp) = ", dp, ")");
  tp_size_ = sizes.tp;
  pp_size_ = sizes.pp;
  dp_size_ = dp;

  const std::array<int, 3> axes = parse_order(order_);
  const std::array<int, 3> axis_size = {tp_size_, dp_size_, pp_size_};
  std::array<int, 3> stride{};
  int next_stride = 1;
  for (int axis : axes) {
    stride[size_t(axis)] = next_stride;
    next_stride *= axis_size[size_t(axis)];
  }
  stride_tp_ = stride[kTp];
  stride_dp_ = stride[kDp];
  stride_pp_ = stride[kPp];

  const int rank = world.rank();
  tp_rank_ = (rank / stride_tp_) % tp_size_;
  dp_rank_ = (rank / stride_dp_) % dp_size_;
  pp_rank_ = (rank / stride_pp_) % pp_size_;

  // Ranks that differ only along an axis share its communicator: the colour
  // is the rank with that coordinate set to 0, the key the coordinate.
  tp_ = world.split(rank - tp_rank_ * stride_tp_, tp_rank_, "tp");
  dp_ = world.split(rank - dp_rank_ * stride_dp_, dp_rank_, "dp");
  pp_ = world.split(rank - pp_rank_ * stride_pp_, pp_rank_, "pp");
}

int ProcessGrid::world_rank_of(int dp, int pp, int tp) const {
  TESSERA_CHECK(dp >= 0 && dp < dp_size_ && pp >= 0 && pp < pp_size_ && tp >= 0 && tp < tp_size_,
                "process grid coordinates (dp ", dp, ", pp ", pp, ", tp ", tp, ") are outside ", describe());
  return dp * stride_dp_ + pp * stride_pp_ + tp * stride_tp_;
}

std::string ProcessGrid::describe() const {
  std::ostringstream out;
  out << "dp=" << dp_size_ << " pp=" << pp_size_ << " tp=" << tp_size_ << " (order " << order_ << ")";
  return out.str();
}

}  // namespace tessera::parallel
