// ProcessGrid: the world's ranks arranged as dp × pp × tp. By default tp
// varies fastest (tensor-parallel ranks are neighbours, so they share a
// node), then dp, then pp, as in Megatron-LM ("tp-dp-pp"); another order can
// be given as a string naming the axes from fastest to slowest. Each axis has
// its sub-communicator: ranks that differ only along that axis.
//
//   world 8, tp 2, pp 2 → dp 2; rank r: tp = r % 2, dp = (r / 2) % 2, pp = r / 4
//
// The sizes are validated with messages that say what does not divide what
// (e.g. "6 ranks cannot make --tensor-parallel 4").
#pragma once

#include <memory>
#include <string>

#include "parallel/communicator.h"

namespace tessera::parallel {

struct GridSizes {
  int tp = 1;
  int pp = 1;
  int dp = 0;                      // 0: world / (tp · pp)
  std::string order = "tp-dp-pp";  // fastest-varying axis first
};

class ProcessGrid {
 public:
  // Collective over `world`; keeps a reference to it.
  ProcessGrid(Communicator& world, const GridSizes& sizes);

  int tp_size() const { return tp_size_; }
  int pp_size() const { return pp_size_; }
  int dp_size() const { return dp_size_; }
  int tp_rank() const { return tp_rank_; }
  int pp_rank() const { return pp_rank_; }
  int dp_rank() const { return dp_rank_; }

  Communicator& world() { return world_; }
  Communicator& tp() { return *tp_; }
  Communicator& pp() { return *pp_; }
  Communicator& dp() { return *dp_; }

  // The world rank at grid coordinates (dp, pp, tp).
  int world_rank_of(int dp, int pp, int tp) const;
  std::string describe() const;  // "dp=2 pp=2 tp=2 (order tp-dp-pp)"

 private:
  Communicator& world_;
  int tp_size_, pp_size_, dp_size_;
  int tp_rank_, pp_rank_, dp_rank_;
  int stride_tp_, stride_dp_, stride_pp_;
  std::unique_ptr<Communicator> tp_, pp_, dp_;
  std::string order_;
};

}  // namespace tessera::parallel
