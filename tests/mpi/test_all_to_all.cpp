// Communicator::all_to_all (the variable all-to-all of expert parallelism's
// token dispatch) under a real mpiexec (2 and 4 ranks with the other MPI
// tests, 3 by itself: tessera_mpi_tests_ring_np3): every rank draws every
// rank's counts and values from the shared test seed, so each knows what it
// must receive; the counts are uneven, a rank receives nothing from anyone,
// another sends nothing at all, and every rank sends itself a block. Outputs
// are poisoned before the call. Over MPI (host tensors, every dtype), over the
// emulated device's channel (the stream communicator NCCL's grouped
// send/recv also runs behind), and over a group of one; all_to_all_counts
// gives each rank the column of the count matrix; counts that do not add
// up to the buffers are refused naming the operation and the numbers.
#include <gtest/gtest.h>
#include <mpi.h>

#include <random>
#include <string>
#include <vector>

#include "core/context.h"
#include "core/device_runtime.h"
#include "core/emulated_runtime.h"
#include "parallel/local_communicator.h"
#include "parallel/mpi_communicator.h"
#include "parallel/process_group.h"
#include "parallel/stream_communicator.h"
#include "tests/mpi/mpi_test.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using parallel::Communicator;

// counts[s][d]: the elements rank s sends rank d. Rank `deaf` receives from
// no one but itself, rank `mute` sends to no one but itself (the same rank
// when there are two), and a rank sends itself a block of at least one.
struct Exchange {
  std::vector<std::vector<int64_t>> counts;
  std::vector<std::vector<std::vector<double>>> values;  // values[s][d]: the block s sends d
};

// n values as `dtype` holds them: floats in [-4, 4) rounded to it, integers in [0, 100).
std::vector<double> block_values(DType dtype, int64_t n, std::mt19937_64& rng) {
  std::vector<double> values(static_cast<size_t>(n));
  for (double& v : values)
    v = is_floating(dtype) ? std::uniform_real_distribution<double>(-4.0, 4.0)(rng)
                           : double(std::uniform_int_distribution<int>(0, 99)(rng));
  return round_to(dtype, std::move(values));
}

Exchange random_exchange(int ranks, DType dtype, std::mt19937_64& rng) {
  Exchange x;
  const int deaf = int(rng() % uint64_t(ranks)), mute = int(rng() % uint64_t(ranks));
  std::uniform_int_distribution<int64_t> count(0, 9);
  x.counts.assign(size_t(ranks), std::vector<int64_t>(size_t(ranks), 0));
  x.values.resize(size_t(ranks));
  for (int s = 0; s < ranks; ++s)
    for (int d = 0; d < ranks; ++d) {
      int64_t n = count(rng);
      if (s != d && (d == deaf || s == mute)) n = 0;
      if (s == d) n = std::max<int64_t>(n, 1);
      x.counts[size_t(s)][size_t(d)] = n;
      x.values[size_t(s)].push_back(block_values(dtype, n, rng));
    }
  return x;
}

// What rank `me` sends (its row, flat) and must receive (its column, flat).
std::vector<double> sent_by(const Exchange& x, int me) {
  std::vector<double> flat;
  for (const auto& block : x.values[size_t(me)]) flat.insert(flat.end(), block.begin(), block.end());
  return flat;
}
std::vector<double> received_by(const Exchange& x, int me) {
  std::vector<double> flat;
  for (const auto& row : x.values) flat.insert(flat.end(), row[size_t(me)].begin(), row[size_t(me)].end());
  return flat;
}
std::vector<int64_t> column(const Exchange& x, int me) {
  std::vector<int64_t> out;
  for (const auto& row : x.counts) out.push_back(row[size_t(me)]);
  return out;
}

// One exchange over `comm` on `device`, checked: the counts first (all_to_all_counts), then the values.
void expect_exchange(Communicator& comm, Context& ctx, Device device, DType dtype, std::mt19937_64& rng) {
  const int ranks = comm.size(), me = comm.rank();
  const Exchange x = random_exchange(ranks, dtype, rng);
  const std::vector<int64_t>& mine = x.counts[size_t(me)];
  const std::vector<int64_t> incoming = parallel::all_to_all_counts(comm, mine, ctx, device);
  EXPECT_EQ(incoming, column(x, me));
  const std::vector<double> send = sent_by(x, me), expected = received_by(x, me);
  const Tensor input = ctx.from_doubles(Shape{int64_t(send.size())}, dtype, send, device);
  Tensor output = poisoned(ctx, Shape{int64_t(expected.size())}, dtype, device);
  comm.all_to_all(input, mine, output, incoming)->wait();
  EXPECT_TRUE(all_close(output, expected, Tolerance{0, 0}));
}

TEST(AllToAll, UnevenCountsAndEmptyBlocksOverMpi) {
  TESSERA_SEED_TRACE();
  auto comm = world();
  Context ctx;
  auto rng = make_rng();
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8})
    for (int round = 0; round < 3; ++round) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " round " + std::to_string(round));
      expect_exchange(*comm, ctx, Device::cpu(), dtype, rng);
    }
  // Only sends and receives between ranks are counted: one send per peer with a block.
  comm->reset_counters();
  const Exchange x = random_exchange(comm->size(), DType::f32, rng);
  int64_t sends = 0;
  for (int d = 0; d < comm->size(); ++d) sends += d != comm->rank() && x.counts[size_t(comm->rank())][size_t(d)] > 0;
  const std::vector<double> send = sent_by(x, comm->rank());
  Tensor output = ctx.empty(Shape{int64_t(received_by(x, comm->rank()).size())}, DType::f32);
  comm->all_to_all(ctx.from_doubles(Shape{int64_t(send.size())}, DType::f32, send), x.counts[size_t(comm->rank())],
                   output, column(x, comm->rank()))
      ->wait();
  EXPECT_EQ(comm->counters().calls[parallel::CommCounters::send], sends);
}

TEST(AllToAll, OnTheEmulatedDevicesChannel) {
  TESSERA_SEED_TRACE();
  Context ctx;
  const Device device = Device::emulated(mpi_env().local_rank() % emulated::kDeviceCount);
  bind_thread_to_device(device);
  auto comm = parallel::make_device_communicator(MPI_COMM_WORLD, "alltoall", ctx, device);
  EXPECT_NE(dynamic_cast<parallel::StreamCommunicator*>(comm.get()), nullptr);
  auto rng = make_rng();
  for (const DType dtype : {DType::f32, DType::bf16, DType::i64})
    for (int round = 0; round < 2; ++round) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " round " + std::to_string(round));
      expect_exchange(*comm, ctx, device, dtype, rng);
    }
}

TEST(AllToAll, AGroupOfOneCopiesItsOwnBlock) {
  TESSERA_SEED_TRACE();
  auto one = parallel::make_local_communicator("one");
  Context ctx;
  auto rng = make_rng();
  expect_exchange(*one, ctx, Device::cpu(), DType::f32, rng);
}

TEST(AllToAll, CountsThatDoNotFitTheBuffersAreRefused) {
  auto comm = world();
  Context ctx;
  const int ranks = comm->size();
  const std::vector<int64_t> twos(size_t(ranks), 2);
  Tensor input = ctx.zeros(Shape{2 * ranks}, DType::f32), output = ctx.zeros(Shape{2 * ranks}, DType::f32);
  Tensor short_output = ctx.zeros(Shape{2 * ranks - 1}, DType::f32);
  const auto refused = [&](auto&& call, const std::string& part) {
    try {
      call();
      ADD_FAILURE() << "no error";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(part), std::string::npos) << error.what();
    }
  };
  refused([&] { comm->all_to_all(input, twos, short_output, twos); },
          "the receive counts add up to " + std::to_string(2 * ranks) + " elements, the output holds " +
              std::to_string(2 * ranks - 1));
  refused([&] { comm->all_to_all(input, std::vector<int64_t>(size_t(ranks) + 1, 0), output, twos); },
          std::to_string(ranks + 1) + " send and " + std::to_string(ranks) + " receive counts for a group of " +
              std::to_string(ranks) + " ranks");
  Tensor ints = ctx.zeros(Shape{2 * ranks}, DType::i32);
  refused([&] { comm->all_to_all(input, twos, ints, twos); }, "the input is f32, the output i32");
}

}  // namespace
}  // namespace tessera::testing
