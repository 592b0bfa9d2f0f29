// Checkpoints under mpiexec (2 and 4 ranks): DataParallel's optimizer-state
// slices give every element of every logical state tensor exactly one owner
// (plain and ZeRO-1, with many small buckets so shards split parameters at
// odd offsets), and a ZeRO-1 checkpoint of N ranks resumes on N/2 ranks, once
// with ZeRO-1 (other shard boundaries) and once without (whole tensors), the
// loss curve going on as in a run that never stopped.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "apps/trainer.h"
#include "core/context.h"
#include "nn/models.h"
#include "models/stage_model.h"
#include "parallel/data_parallel.h"
#include "parallel/mpi_communicator.h"
#include "tests/mpi/mpi_test.h"
#include "tests/support/resume_support.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

TEST(OptimizerStateSlices, EveryElementHasExactlyOneOwner) {
  auto comm = world();
  Context ctx;
  nn::ModelConfig m;
  m.kind = nn::ModelKind::mlp;
  m.hidden = {19, 11};
  m.channels = 1;
  m.height = 5;
  m.width = 5;
  m.num_classes = 7;
  for (const int zero : {0, 1}) {
    SCOPED_TRACE("zero " + std::to_string(zero));
    nn::ModelSpec spec;
    spec.context = &ctx;
    spec.dtype = DType::bf16;  // masters too
    spec.seed = 5;
    std::unique_ptr<nn::Module> model = models::build_model(m, spec);
    const std::vector<nn::Parameter*> parameters = model->parameters();
    nn::OptimizerConfig opt;
    parallel::DataParallelOptions options;
    options.zero_stage = zero;
    options.bucket_size_mb = 300 * 4 / (1024.0 * 1024.0);  // ~300 elements: several buckets
    parallel::DataParallel replica(parameters, *comm, opt, options);

    // Coverage counts of every logical tensor, summed over the ranks.
    std::map<std::string, std::vector<int32_t>> counts;
    for (const nn::Parameter* p : parameters)
      for (const char* state : {".exp_avg", ".exp_avg_sq", ".master"})
        counts[p->name + state].assign(size_t(p->value.numel()), 0);
    for (const parallel::OptimizerStateSlice& slice : replica.optimizer_state_slices()) {
      const auto found = counts.find(slice.name);
      ASSERT_NE(found, counts.end()) << "unexpected state " << slice.name;
      EXPECT_EQ(slice.local->dtype(), DType::f32) << slice.name;
      EXPECT_EQ(slice.flat_range, zero == 1) << slice.name;
      if (!slice.flat_range) {
        EXPECT_EQ(slice.local->shape(), slice.shape) << slice.name;
      }
      if (!slice.owner) continue;
      const int64_t begin = slice.flat_range ? slice.begin : 0;
      ASSERT_LE(begin + slice.local->numel(), slice.shape.numel()) << slice.name;
      for (int64_t i = begin; i < begin + slice.local->numel(); ++i) ++found->second[size_t(i)];
    }
    for (auto& [name, count] : counts) {
      Tensor total = ctx.from_vector(Shape{int64_t(count.size())}, count);
      comm->all_reduce(total, parallel::ReduceOp::sum)->wait();
      const std::vector<int32_t> summed = total.to_vector<int32_t>();
      int64_t wrong = 0;
      for (int32_t value : summed) wrong += value != 1;
      EXPECT_EQ(wrong, 0) << name << ": elements owned by no rank or by several";
    }
  }
}

// A directory every rank sees: named after rank 0's process.
struct SharedDirectory {
  explicit SharedDirectory(parallel::Communicator& comm) {
    int64_t pid = ::getpid();
    MPI_Bcast(&pid, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
    path = fs::temp_directory_path() / ("tessera_mpi_resume_" + std::to_string(pid));
    if (comm.rank() == 0) {
      fs::remove_all(path);
      fs::create_directories(path);
    }
    comm.barrier();
  }
  ~SharedDirectory() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (mpi_env().world_rank() == 0) fs::remove_all(path);
  }
  fs::path path;
};

TEST(Resharding, ZeroCheckpointOfNRanksResumesOnHalfAsMany) {
  TESSERA_SEED_TRACE();
  auto comm = world();
  if (comm->size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  const SharedDirectory dir(*comm);
  std::mt19937_64 rng = make_rng();  // the same on every rank (rank 0's seed)
  const uint64_t seed = rng();       // drawn before rank 0 alone draws the data
  std::string data;
  if (comm->rank() == 0) data = write_image_dataset(dir.path, 384, 5, 4, 3, rng);
  comm->barrier();
  data = (dir.path / "images.h5").string();

  const int ranks = comm->size();
  app::TrainConfig c;
  c.model = nn::ModelKind::mlp;
  c.hidden = {21, 13};
  c.data = data;
  c.micro_batch_size = 4;
  c.global_batch_size = 4 * ranks;  // one micro-batch per rank; two on half as many ranks
  c.train_steps = 8;
  c.warmup_steps = 2;
  c.lr = 3e-3f;
  c.weight_decay = 0.01f;
  c.zero = 1;
  c.bucket_size_mb = 0.0005;
  c.seed = seed;
  c.threads = 1;
  c.log_interval = 1000;
  const app::TrainResult reference = app::train(c);

  app::TrainConfig saving = c;
  saving.save = (dir.path / "run").string();
  saving.exit_interval = 4;
  const app::TrainResult first = app::train(saving);
  ASSERT_EQ(first.final_step, 4);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(first.losses[i], reference.losses[i]) << "step " << i + 1;

  // Half the ranks go on with ZeRO-1 (other shard boundaries), the other
  // half without (whole tensors), each from the same checkpoint. ZeRO needs
  // two data-parallel ranks: halves of one rank (2 ranks) both go without.
  const int color = comm->rank() < ranks / 2 ? 0 : 1;
  const std::unique_ptr<parallel::Communicator> half = comm->split(color, comm->rank(), "half");
  app::TrainConfig resumed = c;
  resumed.zero = color == 0 && ranks / 2 > 1 ? 1 : 0;
  resumed.resume = first.checkpoint;
  resumed.save = (dir.path / ("half" + std::to_string(color))).string();
  const app::TrainResult second = app::train(resumed, *half);
  EXPECT_EQ(second.data_parallel_size, ranks / 2);
  EXPECT_EQ(second.start_step, 4);
  ASSERT_EQ(second.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i)
    EXPECT_NEAR(second.losses[i], reference.losses[4 + i], 1e-5 + 1e-4 * std::abs(reference.losses[4 + i]))
        << "step " << 5 + i << " after resuming on " << ranks / 2 << " rank(s), zero " << resumed.zero;
  comm->barrier();
}

}  // namespace
}  // namespace tessera::testing
