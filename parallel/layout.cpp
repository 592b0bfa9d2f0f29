// Layout (parallel/layout.h): validates the axes' sizes against the world,
// places each rank by the order string (fastest-varying axis first), and
// splits the world into a communicator per axis and per combination asked for.
#include "parallel/layout.h"

#include <algorithm>
#include <sstream>

#include "core/error.h"

namespace tessera::parallel {
namespace {

constexpr size_t kAxes = kLayoutAxes.size();

// The flag that sets each axis, for messages.
constexpr std::array<std::string_view, kAxes> kAxisFlags = {"--tensor-parallel", "--context-parallel-size",
                                                            "--expert-parallel", "the data-parallel size",
                                                            "--pipeline-parallel"};

std::string known_axes() {
  std::string text;
  for (std::string_view axis : kLayoutAxes) {
    if (!text.empty()) text += ", ";
    text += axis;
  }
  return text;
}

// "tp-dp-pp" → the axes' indices, fastest first: each axis at most once; the
// axes of size > 1 must all be there; those left out are appended (size 1).
std::vector<size_t> parse_order(const std::string& order, const std::array<int, kAxes>& sizes) {
  const std::string usage = "--rank-order '" + order + "' must name axes from " + known_axes() +
                            " once each, fastest-varying first, separated by '-' (e.g. tp-cp-ep-dp-pp; axes of "
                            "size 1 may be left out)";
  std::vector<size_t> axes;
  std::array<bool, kAxes> seen{};
  for (size_t begin = 0; begin <= order.size();) {
    const size_t dash = std::min(order.find('-', begin), order.size());
    const std::string_view name = std::string_view(order).substr(begin, dash - begin);
    size_t axis = kAxes;
    for (size_t a = 0; a < kAxes; ++a)
      if (name == kLayoutAxes[a]) axis = a;
    TESSERA_CHECK(axis < kAxes && !seen[axis], usage);
    seen[axis] = true;
    axes.push_back(axis);
    begin = dash + 1;
  }
  for (size_t a = 0; a < kAxes; ++a) {
    TESSERA_CHECK(seen[a] || sizes[a] == 1, "--rank-order '", order, "' leaves out ", kLayoutAxes[a], ", whose size is ",
                  sizes[a], "; name it in the order (e.g. tp-cp-ep-dp-pp)");
    if (!seen[a]) axes.push_back(a);
  }
  return axes;
}

// "8 ranks cannot make --tensor-parallel 3 × --pipeline-parallel 2: ..."
std::string does_not_fit(int world_size, const std::array<int, kAxes>& sizes, int64_t model) {
  std::ostringstream why;
  why << world_size << (world_size == 1 ? " rank" : " ranks") << " cannot make ";
  bool first = true;
  std::string product;
  for (size_t a = 0; a < kAxes; ++a) {
    if (kLayoutAxes[a] == "dp" || sizes[a] == 1) continue;
    why << (first ? "" : " × ") << kAxisFlags[a] << " " << sizes[a];
    if (!first) product += "·";
    product += kLayoutAxes[a];
    first = false;
  }
  why << ": the world size must be a multiple of " << product << " = " << model
      << "; launch a multiple of that many ranks or choose sizes that divide " << world_size;
  return why.str();
}

// "{dp, cp}": a list of axes for a message.
std::string axis_list(const std::vector<std::string>& axes) {
  std::string out = "{";
  for (const std::string& axis : axes) out += (out.size() > 1 ? ", " : "") + axis;
  return out + "}";
}

}  // namespace

size_t Layout::index(std::string_view axis) {
  for (size_t a = 0; a < kAxes; ++a)
    if (kLayoutAxes[a] == axis) return a;
  TESSERA_THROW("layout: no axis '", axis, "'; the axes are ", known_axes());
}

Layout::Layout(Communicator& world, const LayoutSizes& given) : world_(world), order_(given.order) {
  sizes_ = {given.tp, given.cp, given.ep, given.dp, given.pp};
  for (size_t a = 0; a < kAxes; ++a)
    if (kLayoutAxes[a] != "dp")
      TESSERA_CHECK(sizes_[a] >= 1, kAxisFlags[a], " ", sizes_[a], " must be at least 1");
  TESSERA_CHECK(given.dp >= 0, "the data-parallel size ", given.dp,
                " must be at least 1 (or 0: the rest of the world)");
  int64_t model = 1;  // every axis but dp
  for (size_t a = 0; a < kAxes; ++a)
    if (kLayoutAxes[a] != "dp") model *= sizes_[a];
  const int world_size = world.size();
  if (world_size % model != 0) TESSERA_THROW(does_not_fit(world_size, sizes_, model));
  const int dp = int(world_size / model);
  TESSERA_CHECK(given.dp == 0 || given.dp == dp, "the data-parallel size ", given.dp, " × the other axes (", model,
                " ranks) = ", int64_t(given.dp) * model, " ranks, but the world has ", world_size,
                "; leave the data-parallel size out (it is the world size / the other axes = ", dp, ")");
  sizes_[index("dp")] = dp;

  int stride = 1;
  for (size_t axis : parse_order(order_, sizes_)) {
    strides_[axis] = stride;
    stride *= sizes_[axis];
  }
  const int rank = world.rank();
  for (size_t a = 0; a < kAxes; ++a) coordinates_[a] = (rank / strides_[a]) % sizes_[a];
  // Ranks that differ only along an axis share its communicator: the colour
  // is the rank with that coordinate set to 0, the key the coordinate.
  for (size_t a = 0; a < kAxes; ++a)
    axis_groups_[a] = world.split(rank - coordinates_[a] * strides_[a], coordinates_[a], std::string(kLayoutAxes[a]));
}

Communicator& Layout::group(std::initializer_list<std::string_view> axes) {
  unsigned bits = 0;
  for (std::string_view axis : axes) bits |= 1u << index(axis);
  return group_of(bits);
}

Communicator& Layout::group(const std::vector<std::string>& axes) {
  unsigned bits = 0;
  for (const std::string& axis : axes) bits |= 1u << index(axis);
  return group_of(bits);
}

Communicator& Layout::group_of(unsigned bits) {
  TESSERA_CHECK(bits != 0, "layout: a group needs at least one axis (from tp, cp, ep, dp, pp)");
  for (size_t a = 0; a < kAxes; ++a)
    if (bits == (1u << a)) return *axis_groups_[a];
  auto found = combined_groups_.find(bits);
  if (found != combined_groups_.end()) return *found->second;
  // Colour: the rank with the group's coordinates set to 0; key: the rank
  // itself, whose order is the coordinates' with the fastest axis fastest.
  int colour = world_.rank();
  std::string name;
  for (size_t a = 0; a < kAxes; ++a)
    if (bits & (1u << a)) {
      colour -= coordinates_[a] * strides_[a];
      if (!name.empty()) name += "+";
      name += kLayoutAxes[a];
    }
  auto made = world_.split(colour, world_.rank(), name);
  Communicator& group = *made;
  combined_groups_.emplace(bits, std::move(made));
  return group;
}

namespace {

bool names(const std::vector<std::string>& axes, std::string_view axis) {
  return std::find(axes.begin(), axes.end(), axis) != axes.end();
}

// Whether every axis of `narrow` is one of `wide`'s.
bool nests_in(const std::vector<std::string>& narrow, const std::vector<std::string>& wide) {
  return std::all_of(narrow.begin(), narrow.end(), [&](const std::string& axis) { return names(wide, axis); });
}

// The parameter's gradient_axes of size > 1, in the order of kLayoutAxes.
std::vector<std::string> spanned_axes(Layout& layout, const nn::Parameter& parameter) {
  for (const std::string& named : parameter.gradient_axes) layout.size(named);  // refuses an unknown axis
  std::vector<std::string> used;
  for (std::string_view axis : kLayoutAxes)
    if (layout.size(axis) > 1 && names(parameter.gradient_axes, axis)) used.emplace_back(axis);
  return used;
}

}  // namespace

Communicator& gradient_group(Layout& layout, const std::vector<nn::Parameter*>& parameters) {
  TESSERA_CHECK(!parameters.empty(), "layout: no parameters, so no group averages their gradients");
  const std::vector<std::string>& axes = parameters.front()->gradient_axes;
  for (const nn::Parameter* p : parameters)
    TESSERA_CHECK(p->gradient_axes == axes, "layout: parameter '", p->name, "' has its gradient averaged over ",
                  axis_list(p->gradient_axes), " and '", parameters.front()->name, "' over ", axis_list(axes),
                  "; one data-parallel replica reduces every gradient over one group");
  return replicas_along(layout, axes);
}

Communicator& replicas_along(Layout& layout, const std::vector<std::string>& axes) {
  std::vector<std::string> used;  // the axes of size 1 add no rank
  for (const std::string& axis : axes)
    if (layout.size(axis) > 1) used.push_back(axis);
  return used.empty() ? layout.group("dp") : layout.group(used);
}

GradientGroups gradient_groups(Layout& layout, const std::vector<nn::Parameter*>& parameters) {
  TESSERA_CHECK(!parameters.empty(), "layout: no parameters, so no group averages their gradients");
  std::vector<GradientGroup> groups;
  for (nn::Parameter* p : parameters) {
    std::vector<std::string> axes = spanned_axes(layout, *p);
    auto same = std::find_if(groups.begin(), groups.end(), [&](const GradientGroup& g) { return g.axes == axes; });
    if (same == groups.end()) same = groups.insert(groups.end(), GradientGroup{std::move(axes), nullptr, {}});
    same->parameters.push_back(p);
  }
  std::stable_sort(groups.begin(), groups.end(),
                   [](const GradientGroup& a, const GradientGroup& b) { return a.axes.size() > b.axes.size(); });
  for (size_t wide = 0; wide < groups.size(); ++wide)
    for (size_t narrow = wide + 1; narrow < groups.size(); ++narrow)
      TESSERA_CHECK(nests_in(groups[narrow].axes, groups[wide].axes), "layout: parameter '",
                    groups[narrow].parameters.front()->name, "' has its gradient averaged over ",
                    axis_list(groups[narrow].axes), " and '", groups[wide].parameters.front()->name, "' over ",
                    axis_list(groups[wide].axes), "; a replica's gradient groups must nest (an expert's axes a part ",
                    "of a dense parameter's), so give every parameter the default axes {dp, cp, ep} or a part of them");
  // Every rank first makes the groups any stage's parameters average over
  // (dense and experts'), in one order: pipeline stages may hold different
  // kinds (a stage without experts), and making a communicator is collective.
  for (const std::vector<std::string>& axes : {std::vector<std::string>{"dp", "cp", "ep"}, {"dp", "cp"}})
    replicas_along(layout, axes);
  for (GradientGroup& group : groups) group.communicator = &replicas_along(layout, group.axes);
  Communicator* widest = groups.front().communicator;
  return {std::move(groups), widest};
}

Communicator& data_group(Layout& layout) {
  return replicas_along(layout, {"dp", "ep"});
}

int Layout::world_rank_of(const std::map<std::string, int>& coordinates) const {
  int rank = 0;
  for (const auto& [axis, at] : coordinates) {
    const size_t a = index(axis);
    TESSERA_CHECK(at >= 0 && at < sizes_[a], "layout coordinate ", axis, " ", at, " is outside ", describe());
    rank += at * strides_[a];
  }
  return rank;
}

std::map<std::string, int> Layout::coordinates() const {
  std::map<std::string, int> at;
  for (size_t a = 0; a < kAxes; ++a) at[std::string(kLayoutAxes[a])] = coordinates_[a];
  return at;
}

std::string Layout::describe() const {
  std::ostringstream out;
  out << "dp=" << size("dp") << " pp=" << size("pp") << " tp=" << size("tp");
  for (std::string_view axis : {"cp", "ep"})
    if (size(axis) > 1) out << " " << axis << "=" << size(axis);
  out << " (order " << order_ << ")";
  return out.str();
}

PipelineGroups pipeline_groups(Layout& layout, bool end_stage) {
  PipelineGroups groups;
  if (layout.size("pp") == 1) return groups;
  groups.model = &layout.group({"tp", "pp"});
  // The end stages of one position on the other axes share a colour (the world
  // rank of its first stage); every other rank is alone.
  std::map<std::string, int> first_stage = layout.coordinates();
  first_stage["pp"] = 0;
  Communicator& world = layout.world();
  const int colour = end_stage ? layout.world_rank_of(first_stage) : world.size() + world.rank();
  groups.embedding = world.split(colour, world.rank(), "embedding");
  return groups;
}

}  // namespace tessera::parallel
