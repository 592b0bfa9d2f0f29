// MpiEnv: MPI_Init_thread/MPI_Finalize for the life of the process, the world
// and node-local layout (MPI_Comm_split_type with MPI_COMM_TYPE_SHARED), and
// the start-up description of where the ranks run.
//
// Thread level: MPI_THREAD_FUNNELED. Only the main thread calls MPI (the
// background loader and OpenMP workers never do; nonblocking operations are
// progressed by the main thread's poll()/test()/wait() calls).
#include "parallel/mpi_env.h"

#include <cstdlib>

#include <algorithm>
#include <map>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "parallel/mpi_check.h"

namespace tessera::parallel {
namespace {

// Frees a communicator made here for the layout queries.
class OwnedComm {
 public:
  OwnedComm() = default;
  ~OwnedComm() {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  OwnedComm(const OwnedComm&) = delete;
  OwnedComm& operator=(const OwnedComm&) = delete;
  MPI_Comm* out() { return &comm_; }
  MPI_Comm get() const { return comm_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

std::string thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
    default:
      return std::to_string(level);
  }
}

}  // namespace

MpiEnv::MpiEnv() {
  int initialised = 0, finalised = 0;
  TESSERA_MPI_CHECK(MPI_Initialized(&initialised));
  TESSERA_MPI_CHECK(MPI_Finalized(&finalised));
  TESSERA_CHECK(!finalised, "MpiEnv: MPI was already finalised in this process and cannot be started again; ",
                "create one MpiEnv for the whole life of the program");
  if (!initialised) {
    int provided = MPI_THREAD_SINGLE;
    // Open MPI: the stall inspector's one-sided window (parallel/stall_inspector.h)
    // through osc/sm on a node, else osc/pt2pt; osc/rdma in Open MPI 4.1 races
    // on the names of its shared-memory segments and prints a warning. A
    // choice the user exported wins.
    ::setenv("OMPI_MCA_osc", "sm,pt2pt", /*overwrite=*/0);
    TESSERA_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
    initialised_here_ = true;
    if (provided < MPI_THREAD_FUNNELED) {
      MPI_Finalize();
      initialised_here_ = false;
      TESSERA_THROW("MpiEnv: the MPI library provides only ", thread_level_name(provided),
                    ", but Tessera needs MPI_THREAD_FUNNELED (OpenMP and loader threads run beside the MPI calls of "
                    "the main thread); use an MPI built with thread support");
    }
  }
  try {
    TESSERA_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    TESSERA_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_));
    TESSERA_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size_));

    // Ranks that share memory share a node.
    OwnedComm local;
    TESSERA_MPI_CHECK(
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank_, MPI_INFO_NULL, local.out()));
    TESSERA_MPI_CHECK(MPI_Comm_rank(local.get(), &local_rank_));
    TESSERA_MPI_CHECK(MPI_Comm_size(local.get(), &local_size_));

    // Nodes are numbered by their lowest world rank: each node's local rank 0
    // counts the leaders below it, then tells its node.
    const int leader = local_rank_ == 0 ? 1 : 0;
    int leaders_below = 0;
    TESSERA_MPI_CHECK(MPI_Exscan(&leader, &leaders_below, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
    if (world_rank_ == 0) leaders_below = 0;  // MPI_Exscan leaves rank 0's result undefined
    node_index_ = leaders_below;
    TESSERA_MPI_CHECK(MPI_Bcast(&node_index_, 1, MPI_INT, 0, local.get()));
    TESSERA_MPI_CHECK(MPI_Allreduce(&leader, &node_count_, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));

    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int length = 0;
    TESSERA_MPI_CHECK(MPI_Get_processor_name(name, &length));
    hostname_.assign(name, size_t(std::max(length, 0)));
  } catch (...) {
    if (initialised_here_) MPI_Finalize();
    initialised_here_ = false;
    throw;
  }
}

MpiEnv::~MpiEnv() {
  if (!initialised_here_) return;
  int finalised = 0;
  MPI_Finalized(&finalised);
  if (!finalised) MPI_Finalize();
}

Device MpiEnv::default_device(bool cuda, int cuda_devices) const {
  if (!cuda) return Device::cpu();
  TESSERA_CHECK(cuda_devices > 0, "rank ", world_rank_, " on ", hostname_,
                " was asked to use a CUDA device but sees none; use --device cpu, or check CUDA_VISIBLE_DEVICES and "
                "the driver on this node");
  return Device::cuda(local_rank_ % cuda_devices);
}

std::string MpiEnv::describe_layout() const {
  // Every rank's node index and hostname, to every rank.
  struct Entry {
    int node;
    char host[MPI_MAX_PROCESSOR_NAME];
  };
  Entry mine{};
  mine.node = node_index_;
  hostname_.copy(mine.host, sizeof mine.host - 1);
  std::vector<Entry> all(static_cast<size_t>(world_size_));
  TESSERA_MPI_CHECK(
      MPI_Allgather(&mine, int(sizeof(Entry)), MPI_BYTE, all.data(), int(sizeof(Entry)), MPI_BYTE, MPI_COMM_WORLD));

  std::map<int, std::vector<int>> ranks_of_node;
  std::map<int, std::string> host_of_node;
  for (int r = 0; r < world_size_; ++r) {
    ranks_of_node[all[size_t(r)].node].push_back(r);
    host_of_node[all[size_t(r)].node] = all[size_t(r)].host;
  }
  std::ostringstream out;
  out << "world " << world_size_ << (world_size_ == 1 ? " rank" : " ranks") << " on " << node_count_
      << (node_count_ == 1 ? " node" : " nodes") << ", ranks per node ";
  size_t least = size_t(world_size_), most = 0;
  for (const auto& [node, ranks] : ranks_of_node) {
    least = std::min(least, ranks.size());
    most = std::max(most, ranks.size());
  }
  if (least == most)
    out << most;
  else
    out << least << "-" << most;
  out << " (";
  bool first_node = true;
  for (const auto& [node, ranks] : ranks_of_node) {
    out << (first_node ? "" : "; ") << host_of_node[node] << ": ";
    first_node = false;
    // Runs of consecutive ranks as a-b.
    for (size_t i = 0; i < ranks.size();) {
      size_t j = i;
      while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
      out << (i ? "," : "") << ranks[i];
      if (j > i) out << "-" << ranks[j];
      i = j + 1;
    }
  }
  out << ")";
  return out.str();
}

}  // namespace tessera::parallel
