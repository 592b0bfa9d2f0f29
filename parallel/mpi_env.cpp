// MpiEnv: MPI_Init_thread/MPI_Finalize for the life of the process, the world
// and node-local layout (MPI_Comm_split_type with MPI_COMM_TYPE_SHARED), and
// the start-up description of where the ranks run.
//
// Thread level: MPI_THREAD_FUNNELED. Only the main thread calls MPI (the
// background loader and OpenMP workers never do; nonblocking operations are
// progressed by the main thread's poll()/test()/wait() calls).
#include "parallel/mpi_env.h"

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <sstream>
#include <vector>

#include "core/cuda_runtime.h"
#include "core/emulated_runtime.h"
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

// A variable as text, "" when unset.
std::string variable(const std::function<const char*(const char*)>& getenv, const char* name) {
  const char* value = getenv(name);
  return value != nullptr ? value : "";
}

// A positive count from a Slurm variable, 0 when unset or not a number.
long slurm_count(const std::string& text) {
  char* end = nullptr;
  const long count = std::strtol(text.c_str(), &end, 10);
  return end != text.c_str() && count > 0 ? count : 0;
}

}  // namespace

std::string launch_problem(const std::function<const char*(const char*)>& getenv, bool open_mpi) {
  if (variable(getenv, "TESSERA_LAUNCH_CHECK") == "0") return "";
  // What launchers give each rank: Open MPI's mpirun (OMPI_*, PMIX_*), srun
  // --mpi=pmix (PMIX_*) or --mpi=pmi2 (PMI_*), MPICH/Intel MPI's Hydra (PMI_*),
  // MVAPICH (MV2_*).
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
                           "PMI_FD", "MV2_COMM_WORLD_RANK", "MPI_LOCALRANKID"})
    if (!variable(getenv, name).empty()) return "";
  std::string job = variable(getenv, "SLURM_JOB_ID");
  if (job.empty()) job = variable(getenv, "SLURM_JOBID");
  if (job.empty()) return "";  // not in Slurm: a plain start is a world of one
  std::string step = variable(getenv, "SLURM_STEP_ID");
  if (step.empty()) step = variable(getenv, "SLURM_STEPID");
  if (!step.empty()) {
    // srun started this process but gave it no MPI plugin's variables. Open MPI
    // then takes it for a direct launch it cannot join, and MPI_Init fails;
    // other MPIs may read Slurm's PMI-1 library directly, so they are let be.
    if (!open_mpi) return "";
    return "this process was started by srun (Slurm job " + job + ", step " + step +
           ") without an MPI plugin (srun --mpi=none, or MpiDefault=none in slurm.conf), so Open MPI cannot connect "
           "the ranks and MPI_Init would fail; launch with `srun --mpi=pmix tessera train ...` (`srun --mpi=list` "
           "shows this cluster's plugins), or set TESSERA_LAUNCH_CHECK=0 if a launcher Tessera does not know started "
           "it";
  }
  long tasks = slurm_count(variable(getenv, "SLURM_NTASKS"));
  std::string tasks_variable = "SLURM_NTASKS";
  if (tasks == 0) {
    tasks = slurm_count(variable(getenv, "SLURM_NPROCS"));
    tasks_variable = "SLURM_NPROCS";
  }
  long nodes = slurm_count(variable(getenv, "SLURM_JOB_NUM_NODES"));
  if (nodes == 0) nodes = slurm_count(variable(getenv, "SLURM_NNODES"));
  std::string allocation;
  if (tasks > 1)
    allocation = std::to_string(tasks) + " tasks (" + tasks_variable + "=" + std::to_string(tasks) + ")";
  else if (tasks == 0 && nodes > 1)
    allocation = std::to_string(nodes) + " nodes (SLURM_JOB_NUM_NODES=" + std::to_string(nodes) + ")";
  else
    return "";  // a one-task allocation: one rank is what it asked for
  const std::string ranks = tasks > 1 ? std::to_string(tasks) : "N";
  return "this process was started plainly (not by srun or mpirun) inside Slurm job " + job +
         ", whose allocation has " + allocation +
         ", so it would train alone as one rank while the rest of the allocation idles. Launch the ranks from the "
         "batch script with `srun --mpi=pmix tessera train ...` (or `mpirun -np " +
         ranks +
         " tessera train ...`); to train on one rank on purpose, use `srun -n 1 --mpi=pmix tessera train ...` or set "
         "TESSERA_LAUNCH_CHECK=0";
}

MpiEnv::MpiEnv() {
  int initialised = 0, finalised = 0;
  TESSERA_MPI_CHECK(MPI_Initialized(&initialised));
  TESSERA_MPI_CHECK(MPI_Finalized(&finalised));
  TESSERA_CHECK(!finalised, "MpiEnv: MPI was already finalised in this process and cannot be started again; ",
                "create one MpiEnv for the whole life of the program");
  if (!initialised) {
    // Before MPI_Init, which in these cases runs as one rank or fails with Open MPI's text.
    char library[MPI_MAX_LIBRARY_VERSION_STRING] = {};
    int length = 0;
    MPI_Get_library_version(library, &length);  // allowed before MPI_Init (MPI-3)
    const std::string problem = launch_problem([](const char* name) { return std::getenv(name); },
                                               std::string(library).find("Open MPI") != std::string::npos);
    TESSERA_CHECK(problem.empty(), problem);
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

Device MpiEnv::device_for_flag(const std::string& flag) const {
  if (flag == "cuda") return default_device(true, cuda_runtime::device_count());
  if (flag == "emu") return Device::emulated(local_rank() % emulated::kDeviceCount);
  return parse_device(flag);
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
