// Layout: the world's ranks arranged over named axes (the parallelism a run
// has), replacing the fixed dp × pp × tp grid. The axes, by name:
//
//   tp  tensor parallelism (and sequence parallelism within it)
//   cp  context parallelism (the sequence split over ranks)
//   ep  expert parallelism (room for the mixture of experts)
//   dp  data parallelism (the replicas; by default the rest of the world)
//   pp  pipeline stages
//
// An order string names the axes from the fastest-varying to the slowest
// ("tp-cp-ep-dp-pp", Megatron-Core's default: tensor-parallel ranks are
// neighbours, so they share a node); an axis of size 1 may be left out of it.
// Rank r's coordinate along an axis is (r / stride) % size, the strides
// being the products of the sizes of the axes before it in the order:
//
//   world 8, tp 2, pp 2 → dp 2; rank r: tp = r % 2, dp = (r / 2) % 2, pp = r / 4
//
// Every axis has its communicator (the ranks that differ only along it,
// made by the constructor); any combination of axes has one too
// (group({"dp", "cp"}): the ranks that differ only along those axes), made
// on first use. Sizes that do not fit the world are refused naming the flags.
#pragma once

#include <array>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "nn/parameter.h"
#include "parallel/communicator.h"

namespace tessera::parallel {

// The axes a layout knows, in Megatron-Core's default order (fastest first).
inline constexpr std::array<std::string_view, 5> kLayoutAxes = {"tp", "cp", "ep", "dp", "pp"};

struct LayoutSizes {
  int tp = 1, cp = 1, ep = 1, pp = 1;
  int dp = 0;                         // 0: world / (tp · cp · ep · pp)
  std::string order = "tp-cp-ep-dp-pp";  // fastest-varying axis first; axes of size 1 may be left out
};

class Layout {
 public:
  // Collective over `world`; keeps a reference to it.
  Layout(Communicator& world, const LayoutSizes& sizes);

  // The size of `axis` and this rank's coordinate along it (1 and 0 for a known axis of size 1).
  int size(std::string_view axis) const { return sizes_[index(axis)]; }
  int rank(std::string_view axis) const { return coordinates_[index(axis)]; }

  Communicator& world() { return world_; }
  // The ranks that differ from this one only along `axis`, in coordinate order.
  Communicator& group(std::string_view axis) { return *axis_groups_[index(axis)]; }
  // The ranks that differ only along `axes` (any of them), ordered by their
  // coordinates with the fastest axis of the order varying fastest.
  // Collective over the world the first time a combination is asked for:
  // every rank asks for the same combinations in the same order.
  Communicator& group(std::initializer_list<std::string_view> axes);
  Communicator& group(const std::vector<std::string>& axes);

  // The world rank at the given coordinates (axes not named: 0), and this rank's coordinates.
  int world_rank_of(const std::map<std::string, int>& coordinates) const;
  std::map<std::string, int> coordinates() const;
  // "dp=2 pp=2 tp=2 (order tp-dp-pp)": the axes of size > 1 (dp always), and the order.
  std::string describe() const;
  // The order string as given.
  const std::string& order() const { return order_; }

 private:
  static size_t index(std::string_view axis);
  Communicator& group_of(unsigned axes);  // by the bit set of the axes' indices

  Communicator& world_;
  std::string order_;
  std::array<int, kLayoutAxes.size()> sizes_{}, coordinates_{}, strides_{};
  std::array<std::unique_ptr<Communicator>, kLayoutAxes.size()> axis_groups_;
  std::map<unsigned, std::unique_ptr<Communicator>> combined_groups_;  // by the bit set of their axes
};

// The groups a pipelined replica needs beyond its axes: `model`, every rank
// of one replica (the model-parallel axes: the gradient norm's group), and
// `embedding`, the first and last stage of one replica's position on the
// other axes (the tied embedding's two copies; `end_stage`: this rank holds
// one). Collective over the world; both null with one stage.
struct PipelineGroups {
  Communicator* model = nullptr;
  std::unique_ptr<Communicator> embedding;
};
PipelineGroups pipeline_groups(Layout& layout, bool end_stage);

// The group that averages the gradients of `parameters`: the ranks that
// differ only along their nn::Parameter::gradient_axes (those of size 1
// left out; none left: the dp axis's group of one). Every parameter must
// name the same axes (one replica reduces over one group), else refused
// naming two that differ. Collective the first time a combination is used.
Communicator& gradient_group(Layout& layout, const std::vector<nn::Parameter*>& parameters);

// The ranks that differ only along `axes` (those of size 1 left out; none
// left: the dp axis's group of one). Collective the first time.
Communicator& replicas_along(Layout& layout, const std::vector<std::string>& axes);
// The ranks that read different samples: dp and ep (expert parallelism lies
// within the data-parallel ranks, as Megatron-Core places it). Rank r of them
// reads samples [r·B, (r+1)·B) of each global micro-batch.
Communicator& data_group(Layout& layout);
// A replica's parameters split by the group that averages their gradients
// (under expert parallelism dense parameters over dp, cp and ep, an expert
// over dp and cp): parameters whose gradient_axes of size > 1 are the same
// share a group, so without expert parallelism there is one. Groups come
// widest first (their communicators made in that order, collectively the
// first time: every rank must hold parameters of the same combinations),
// each with its parameters in the order given. Their axes must nest, each
// group's a part of every wider one's (an expert's dp and cp within the dense
// dp, cp and ep); a mix that does not is refused naming two parameters.
// `replicas` is the widest group: over it the groups' gradient norms add up
// to the replica's (GradientGroup::communicator's cosets in it hold
// different parameters, e.g. each ep rank its experts).
struct GradientGroup {
  std::vector<std::string> axes;  // the axes of size > 1 it spans (empty: a group of one)
  Communicator* communicator = nullptr;
  std::vector<nn::Parameter*> parameters;
};
struct GradientGroups {
  std::vector<GradientGroup> groups;
  Communicator* replicas = nullptr;
};
GradientGroups gradient_groups(Layout& layout, const std::vector<nn::Parameter*>& parameters);

}  // namespace tessera::parallel
