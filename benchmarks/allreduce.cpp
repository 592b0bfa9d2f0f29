// All-reduce benchmark, run under mpirun: f32 sums of 1, 16 and 64 MiB
// through Tessera's MPI communicator (all_reduce(sum) + wait) against
// MPI_Allreduce called directly on the same buffer. The two are interleaved
// (alternating which goes first) so drifting clocks and neighbours hit both
// alike; each sample is the slowest rank's time after a barrier, each figure
// the median of --repeats samples after --warmup untimed runs. Bandwidth as
// nccl-tests defines it: algbw = bytes / time, busbw = algbw · 2(n−1)/n.
// Prints machine-readable lines (rank 0 only):
//   allreduce ranks=2 mpi="Open MPI v4.1.4, ..."
//   allreduce bytes=1048576 impl=tessera time_us=210.3 algbw_gbps=4.99 allreduce_busbw_gbps=4.99
//   allreduce bytes=1048576 impl=mpi time_us=208.8 algbw_gbps=5.02 allreduce_busbw_gbps=5.02
//   allreduce bytes=1048576 ratio=0.99
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "core/context.h"
#include "parallel/library_versions.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_env.h"

namespace {

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

// The slowest rank's time for `fn`, started together after a barrier.
template <typename Fn>
double timed(Fn&& fn) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double start = MPI_Wtime();
  fn();
  const double mine = MPI_Wtime() - start;
  double slowest = 0;
  MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tessera;
  parallel::MpiEnv env;
  CLI::App app{"all-reduce: Tessera's MPI communicator vs MPI_Allreduce, busbw as nccl-tests defines it"};
  std::vector<int64_t> kibibytes{1024, 16 * 1024, 64 * 1024};
  int repeats = 21, warmup = 3;
  app.add_option("--sizes-kib", kibibytes, "buffer sizes in KiB (default 1, 16 and 64 MiB)")->delimiter(',');
  app.add_option("--repeats", repeats, "timed runs per implementation (median reported)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed runs per implementation first");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return env.is_root() ? app.exit(error) : (error.get_exit_code() == 0 ? 0 : 1);
  }

  try {
    Context ctx;
    auto comm = parallel::make_mpi_communicator(MPI_COMM_WORLD, "world");
    const int ranks = comm->size();
    if (env.is_root()) std::printf("allreduce ranks=%d mpi=\"%s\"\n", ranks, mpi_library_version().c_str());

    for (int64_t kib : kibibytes) {
      const int64_t bytes = kib << 10;
      const int64_t count = bytes / int64_t(sizeof(float));
      Tensor buffer = ctx.full(Shape{count}, DType::f32, double(comm->rank() + 1));
      // Correctness first: every element must be 1 + 2 + ... + ranks.
      comm->all_reduce(buffer, parallel::ReduceOp::sum)->wait();
      const float expected = float(ranks) * float(ranks + 1) / 2;
      const std::vector<float> values = buffer.to_vector<float>();
      const bool correct = std::all_of(values.begin(), values.end(), [&](float v) { return v == expected; });
      TESSERA_CHECK(correct, "allreduce benchmark: the communicator's sum of ", bytes, " bytes is wrong");
      buffer.fill_(0.0);  // repeated in-place sums of zeros stay finite and normal

      auto tessera_run = [&] { comm->all_reduce(buffer, parallel::ReduceOp::sum)->wait(); };
      auto mpi_run = [&] {
        MPI_Allreduce(MPI_IN_PLACE, buffer.data_ptr(), int(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      };
      for (int i = 0; i < warmup; ++i) {
        tessera_run();
        mpi_run();
      }
      std::vector<double> tessera_times, mpi_times;
      for (int i = 0; i < repeats; ++i) {
        if (i % 2 == 0) {
          tessera_times.push_back(timed(tessera_run));
          mpi_times.push_back(timed(mpi_run));
        } else {
          mpi_times.push_back(timed(mpi_run));
          tessera_times.push_back(timed(tessera_run));
        }
      }
      const double bus_factor = ranks > 1 ? 2.0 * (ranks - 1) / ranks : 1.0;
      auto report = [&](const char* impl, double seconds) {
        const double algbw = double(bytes) / seconds * 1e-9;
        if (env.is_root())
          std::printf("allreduce bytes=%lld impl=%s time_us=%.1f algbw_gbps=%.2f allreduce_busbw_gbps=%.2f\n",
                      static_cast<long long>(bytes), impl, seconds * 1e6, algbw, algbw * bus_factor);
      };
      const double tessera_time = median(tessera_times), mpi_time = median(mpi_times);
      report("tessera", tessera_time);
      report("mpi", mpi_time);
      // busbw ratio = time ratio (same bytes, same ranks).
      if (env.is_root())
        std::printf("allreduce bytes=%lld ratio=%.3f\n", static_cast<long long>(bytes), mpi_time / tessera_time);
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "%s\n", error.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  return 0;
}
