// The MPI communicator under a real mpiexec (2 and 4 ranks): every collective
// for every dtype against references that each rank computes itself. All
// ranks share one test seed (test_main.cpp), so every rank generates every
// rank's input and knows what the collective must return.
//
// References are exact: f32 inputs are multiples of 2^-20 in [-1, 1] and
// bf16/f16 inputs have magnitudes of at least 2^-10, so sums of up to 8 of
// them are exact in f32 whatever the order MPI adds them in; the reference
// then rounds the exact sum (and avg's f32 division) to the dtype once, which
// is what "reduce in f32, round back" must give. A reduction carried out in
// bf16/f16 would round each partial sum and fail with 4 ranks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <thread>

#include "core/context.h"
#include "core/device_runtime.h"
#include "core/emulated_runtime.h"
#include "parallel/mpi_communicator.h"
#include "parallel/process_group.h"
#include "parallel/stream_communicator.h"
#include "tests/kernels/dtype_params.h"
#include "tests/mpi/mpi_test.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

using parallel::CommCounters;
using parallel::CommHandle;
using parallel::Communicator;
using parallel::P2POp;
using parallel::ReduceOp;

constexpr int kExactRanks = 8;  // references are exact up to this many ranks (see the top)

const char* op_name(ReduceOp op) {
  return op == ReduceOp::sum ? "sum" : op == ReduceOp::avg ? "avg" : "max";
}

// n random values as `dtype` stores them, drawn the same way on every rank.
std::vector<double> random_values(DType dtype, int64_t n, std::mt19937_64& rng) {
  std::vector<double> values(size_t(std::max<int64_t>(n, 0)));
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  for (double& v : values) {
    switch (dtype) {
      case DType::f32:
        v = std::ldexp(double(std::uniform_int_distribution<int64_t>(-(1 << 20), 1 << 20)(rng)), -20);
        break;
      case DType::bf16:
      case DType::f16:
        do v = unit(rng);
        while (std::abs(v) < std::ldexp(1.0, -10));
        break;
      case DType::i32:
        v = double(std::uniform_int_distribution<int64_t>(-1000000, 1000000)(rng));
        break;
      case DType::i64:  // sums beyond 32 bits, still exact in a double
        v = double(std::uniform_int_distribution<int64_t>(-(int64_t(1) << 40), int64_t(1) << 40)(rng));
        break;
      case DType::u8:  // full range: sums wrap modulo 256
        v = double(std::uniform_int_distribution<int>(0, 255)(rng));
        break;
    }
  }
  return round_to(dtype, std::move(values));
}

// inputs[r]: rank r's values.
std::vector<std::vector<double>> every_ranks_values(DType dtype, int64_t n, int ranks, std::mt19937_64& rng) {
  std::vector<std::vector<double>> inputs;
  for (int r = 0; r < ranks; ++r) inputs.push_back(random_values(dtype, n, rng));
  return inputs;
}

// The reduction of element `i` over ranks, as the communicator must return it.
double reduce_reference(DType dtype, ReduceOp op, const std::vector<std::vector<double>>& inputs, size_t i) {
  const int ranks = int(inputs.size());
  if (op == ReduceOp::max) {
    double best = inputs[0][i];
    for (const auto& in : inputs) best = std::max(best, in[i]);
    return best;
  }
  if (is_floating(dtype)) {
    double sum = 0;
    for (const auto& in : inputs) sum += in[i];  // exact (see the top)
    float result = float(sum);
    if (op == ReduceOp::avg) result /= float(ranks);
    return round_to(dtype, {double(result)})[0];
  }
  int64_t sum = 0;
  for (const auto& in : inputs) sum += int64_t(in[i]);
  if (op == ReduceOp::avg) sum /= ranks;  // truncated toward zero; u8: of the true sum
  if (dtype == DType::u8) sum &= 0xff;    // a u8 sum wraps modulo 256
  return double(sum);
}

Tolerance exact_for(int ranks) {
  return ranks <= kExactRanks ? Tolerance{0, 0} : Tolerance{1e-2, 1e-5};
}

class Collective : public DtypeTest {
 protected:
  Context ctx_;
  std::unique_ptr<Communicator> world_ = parallel::make_mpi_communicator(MPI_COMM_WORLD, "world");
  int ranks_ = world_->size();
  int me_ = world_->rank();
};

using AllReduce = Collective;
TEST_P(AllReduce, SumAvgMaxOfOddSizes) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  auto rng = make_rng();
  for (int64_t n : {0, 1, 37, 4099}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      SCOPED_TRACE(std::string(op_name(op)) + " of " + std::to_string(n) + " elements");
      const auto inputs = every_ranks_values(dtype, n, ranks_, rng);
      Tensor tensor = ctx_.from_doubles(Shape{n}, dtype, inputs[size_t(me_)]);
      world_->all_reduce(tensor, op)->wait();
      std::vector<double> expected(static_cast<size_t>(n));
      for (size_t i = 0; i < expected.size(); ++i) expected[i] = reduce_reference(dtype, op, inputs, i);
      EXPECT_TRUE(all_close(tensor, expected, exact_for(ranks_)));
    }
  }
}

TEST_P(AllReduce, MatrixCountsElements) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  auto rng = make_rng();
  const auto inputs = every_ranks_values(dtype, 5 * 7, ranks_, rng);
  Tensor tensor = ctx_.from_doubles(Shape{5, 7}, dtype, inputs[size_t(me_)]);
  world_->all_reduce(tensor, ReduceOp::sum)->wait();
  std::vector<double> expected(35);
  for (size_t i = 0; i < expected.size(); ++i) expected[i] = reduce_reference(dtype, ReduceOp::sum, inputs, i);
  EXPECT_EQ(tensor.shape(), (Shape{5, 7}));
  EXPECT_TRUE(all_close(tensor, expected, exact_for(ranks_)));
}

using ReduceScatter = Collective;
TEST_P(ReduceScatter, BlockOfEachRankForOddBlocks) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  auto rng = make_rng();
  for (int64_t block : {1, 13, 257}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      SCOPED_TRACE(std::string(op_name(op)) + ", blocks of " + std::to_string(block));
      const auto inputs = every_ranks_values(dtype, block * ranks_, ranks_, rng);
      const Tensor input = ctx_.from_doubles(Shape{block * ranks_}, dtype, inputs[size_t(me_)]);
      Tensor output = poisoned(ctx_, Shape{block}, dtype);
      world_->reduce_scatter(input, output, op)->wait();
      std::vector<double> expected(static_cast<size_t>(block));
      for (size_t i = 0; i < expected.size(); ++i)
        expected[i] = reduce_reference(dtype, op, inputs, size_t(me_ * block) + i);
      EXPECT_TRUE(all_close(output, expected, exact_for(ranks_)));
      // The input is left as it was.
      EXPECT_TRUE(all_close(input, inputs[size_t(me_)], {0, 0}));
    }
  }
}

using AllGather = Collective;
TEST_P(AllGather, BlocksInRankOrder) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  auto rng = make_rng();
  for (int64_t block : {1, 13, 257}) {
    SCOPED_TRACE("blocks of " + std::to_string(block));
    const auto inputs = every_ranks_values(dtype, block, ranks_, rng);
    const Tensor input = ctx_.from_doubles(Shape{block}, dtype, inputs[size_t(me_)]);
    Tensor output = poisoned(ctx_, Shape{ranks_, block}, dtype);
    world_->all_gather(input, output)->wait();
    std::vector<double> expected;
    for (const auto& in : inputs) expected.insert(expected.end(), in.begin(), in.end());
    EXPECT_TRUE(all_close(output, expected, {0, 0}));
  }
}

TEST_P(AllGather, InPlaceWhenTheInputIsThisRanksBlock) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  auto rng = make_rng();
  const int64_t block = 29;
  const auto inputs = every_ranks_values(dtype, block, ranks_, rng);
  Tensor output = poisoned(ctx_, Shape{ranks_ * block}, dtype);
  Tensor mine = output.slice(me_ * block, (me_ + 1) * block);
  mine.copy_(ctx_.from_doubles(Shape{block}, dtype, inputs[size_t(me_)]));
  world_->all_gather(mine, output)->wait();
  std::vector<double> expected;
  for (const auto& in : inputs) expected.insert(expected.end(), in.begin(), in.end());
  EXPECT_TRUE(all_close(output, expected, {0, 0}));
}

using Broadcast = Collective;
TEST_P(Broadcast, FromEveryRoot) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  auto rng = make_rng();
  for (int root = ranks_ - 1; root >= 0; --root) {  // the last rank first: a non-zero root
    SCOPED_TRACE("root " + std::to_string(root));
    const auto inputs = every_ranks_values(dtype, 101, ranks_, rng);
    Tensor tensor =
        me_ == root ? ctx_.from_doubles(Shape{101}, dtype, inputs[size_t(me_)]) : poisoned(ctx_, Shape{101}, dtype);
    world_->broadcast(tensor, root)->wait();
    EXPECT_TRUE(all_close(tensor, inputs[size_t(root)], {0, 0}));
  }
}

using PointToPoint = Collective;
TEST_P(PointToPoint, RingOfSendsAndReceives) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  auto rng = make_rng();
  const auto inputs = every_ranks_values(dtype, 77, ranks_, rng);
  const int next = (me_ + 1) % ranks_, previous = (me_ + ranks_ - 1) % ranks_;
  const Tensor outgoing = ctx_.from_doubles(Shape{77}, dtype, inputs[size_t(me_)]);
  Tensor incoming = poisoned(ctx_, Shape{77}, dtype);
  // Send first, receive second: nonblocking calls cannot deadlock either way.
  CommHandle sent = world_->send(outgoing, next);
  CommHandle received = world_->recv(incoming, previous);
  received->wait();
  sent->wait();
  EXPECT_TRUE(all_close(incoming, inputs[size_t(previous)], {0, 0}));
}

TEST_P(PointToPoint, GroupedExchangeWithEveryRankInAnyOrder) {
  TESSERA_SEED_TRACE();
  const DType dtype = GetParam();
  auto rng = make_rng();
  // Two messages from every rank s to every rank d (itself included), of
  // different odd sizes; message k from s to d holds values[s][d][k].
  auto size_of = [&](int s, int d, int k) { return int64_t(1 + 3 * s + 5 * d + 7 * k); };
  std::vector<std::vector<std::vector<std::vector<double>>>> values(static_cast<size_t>(ranks_));
  for (int s = 0; s < ranks_; ++s) {
    values[size_t(s)].resize(size_t(ranks_));
    for (int d = 0; d < ranks_; ++d)
      for (int k = 0; k < 2; ++k) values[size_t(s)][size_t(d)].push_back(random_values(dtype, size_of(s, d, k), rng));
  }
  // Sends listed before receives, highest peer first: a blocking
  // implementation would deadlock.
  std::vector<P2POp> ops;
  std::vector<std::pair<int, int>> receive_ids;
  std::vector<Tensor> received;
  for (int d = ranks_ - 1; d >= 0; --d)
    for (int k = 0; k < 2; ++k)
      ops.push_back({P2POp::Kind::send,
                     ctx_.from_doubles(Shape{size_of(me_, d, k)}, dtype, values[size_t(me_)][size_t(d)][size_t(k)]),
                     d});
  for (int s = ranks_ - 1; s >= 0; --s)
    for (int k = 0; k < 2; ++k) {
      received.push_back(poisoned(ctx_, Shape{size_of(s, me_, k)}, dtype));
      receive_ids.push_back({s, k});
      ops.push_back({P2POp::Kind::recv, received.back(), s});
    }
  world_->send_recv(ops)->wait();
  for (size_t i = 0; i < received.size(); ++i) {
    const auto [s, k] = receive_ids[i];
    EXPECT_TRUE(all_close(received[i], values[size_t(s)][size_t(me_)][size_t(k)], {0, 0}))
        << "message " << k << " from rank " << s;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, AllReduce,
                         ::testing::Values(DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8),
                         dtype_param_name);
INSTANTIATE_TEST_SUITE_P(Dtypes, ReduceScatter,
                         ::testing::Values(DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8),
                         dtype_param_name);
INSTANTIATE_TEST_SUITE_P(Dtypes, AllGather,
                         ::testing::Values(DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8),
                         dtype_param_name);
INSTANTIATE_TEST_SUITE_P(Dtypes, Broadcast,
                         ::testing::Values(DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8),
                         dtype_param_name);
INSTANTIATE_TEST_SUITE_P(Dtypes, PointToPoint,
                         ::testing::Values(DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8),
                         dtype_param_name);

// ---------------------------------------------------------------------------

class MpiCommunicatorTest : public ::testing::Test {
 protected:
  Context ctx_;
  std::unique_ptr<Communicator> world_ = parallel::make_mpi_communicator(MPI_COMM_WORLD, "world");
  int ranks_ = world_->size();
  int me_ = world_->rank();
};

TEST_F(MpiCommunicatorTest, EveryRankHasTheSameTestSeed) {
  const std::vector<int64_t> mine = {int64_t(test_seed())};
  Tensor seed = ctx_.from_vector(Shape{1}, mine);
  Tensor all = ctx_.empty(Shape{ranks_}, DType::i64);
  world_->all_gather(seed, all)->wait();
  for (int64_t s : all.to_vector<int64_t>()) EXPECT_EQ(uint64_t(s), test_seed());
}

TEST_F(MpiCommunicatorTest, ReduceScatterIntoASliceOfItsOwnInput) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  const int64_t block = 11;
  const auto inputs = every_ranks_values(DType::f32, block * ranks_, ranks_, rng);
  Tensor buffer = ctx_.from_doubles(Shape{block * ranks_}, DType::f32, inputs[size_t(me_)]);
  Tensor mine = buffer.slice(me_ * block, (me_ + 1) * block);  // overlaps the input: staged
  world_->reduce_scatter(buffer, mine, ReduceOp::sum)->wait();
  std::vector<double> expected(static_cast<size_t>(block));
  for (size_t i = 0; i < expected.size(); ++i)
    expected[i] = reduce_reference(DType::f32, ReduceOp::sum, inputs, size_t(me_ * block) + i);
  EXPECT_TRUE(all_close(mine, expected, exact_for(ranks_)));
}

TEST_F(MpiCommunicatorTest, BarrierHoldsEveryRankUntilAllArrive) {
  // Each rank creates its file after a rank-dependent pause; after the
  // barrier every file must exist. Without a barrier, rank 0 would look
  // before the later ranks wrote theirs.
  long run = long(getpid());
  MPI_Bcast(&run, 1, MPI_LONG, 0, MPI_COMM_WORLD);  // rank 0's pid names this run's files
  const auto dir = std::filesystem::temp_directory_path();
  auto file_of = [&](int round, int rank) {
    return dir / ("tessera_barrier_" + std::to_string(run) + "_" + std::to_string(round) + "_" + std::to_string(rank));
  };
  for (int round = 0; round < 2; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(40 * ((me_ + round) % ranks_)));
    std::ofstream(file_of(round, me_)) << me_;
    world_->barrier();
    for (int r = 0; r < ranks_; ++r)
      EXPECT_TRUE(std::filesystem::exists(file_of(round, r))) << "round " << round << ": rank " << r << "'s file";
    world_->barrier();  // nobody removes a file before everyone has looked
    std::filesystem::remove(file_of(round, me_));
  }
}

// CommCounters::seconds is the time a rank spends inside the communicator:
// the last rank sleeps before it joins an all-reduce (issued, then waited),
// a point-to-point exchange (send_recv, waited) and a barrier; every other
// rank's counted time covers those sleeps, the sleeper's is small, and each
// rank's count is within its own stopwatch around the calls. The ranks leave
// the MPI_Barrier before it at slightly different times (a rank may be
// descheduled: 4 ranks share 2 cores), hence 0.1 s of slack per sleep.
TEST_F(MpiCommunicatorTest, SecondsCountTheTimeARankWaitsInItsOperations) {
  const auto sleep = std::chrono::milliseconds(400);
  const double slept = 0.4, slack = 0.1;
  const int sleeper = ranks_ - 1, next = (me_ + 1) % ranks_, previous = (me_ + ranks_ - 1) % ranks_;
  auto other = world_->split(0, me_, "other");  // waits for nothing: counts nothing
  Tensor x = ctx_.full(Shape{1000}, DType::f32, 1.0);
  Tensor out = ctx_.full(Shape{1000}, DType::f32, 2.0), in = ctx_.empty(Shape{1000}, DType::f32);
  MPI_Barrier(MPI_COMM_WORLD);
  world_->reset_counters();
  EXPECT_EQ(world_->counters().seconds, 0.0);
  const auto start = std::chrono::steady_clock::now();
  if (me_ == sleeper) std::this_thread::sleep_for(sleep);
  CommHandle reduction = world_->all_reduce(x, ReduceOp::sum);
  reduction->wait();
  if (me_ == sleeper) std::this_thread::sleep_for(sleep);
  world_->send_recv({{P2POp::Kind::send, out, next}, {P2POp::Kind::recv, in, previous}})->wait();
  if (me_ == sleeper) std::this_thread::sleep_for(sleep);
  world_->barrier();
  const double stopwatch = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double counted = world_->counters().seconds;
  EXPECT_EQ(x.to_vector<float>(), std::vector<float>(1000, float(ranks_)));
  EXPECT_EQ(in.to_vector<float>(), std::vector<float>(1000, 2.0f));
  EXPECT_LE(counted, stopwatch) << "rank " << me_;
  if (me_ == sleeper) {
    EXPECT_LT(counted, 3 * slack) << "rank " << me_ << " came last to every operation";
  } else {
    // Every rank but the sleeper waits for it in the all-reduce and the
    // barrier; in the exchange only rank 0 does (it receives from the sleeper).
    const double waits = me_ == 0 ? 3 : 2;
    EXPECT_GE(counted, waits * (slept - slack)) << "rank " << me_;
  }
  EXPECT_EQ(world_->counters().calls[parallel::CommCounters::all_reduce], 1);
  EXPECT_EQ(other->counters().seconds, 0.0);
  world_->reset_counters();
  EXPECT_EQ(world_->counters().seconds, 0.0);
  EXPECT_EQ(world_->counters().total_bytes(), 0);
}

TEST_F(MpiCommunicatorTest, SequenceCountsOperationsAndErrorsNameThem) {
  EXPECT_EQ(world_->sequence(), 0u);
  Tensor x = ctx_.full(Shape{3}, DType::f32, 1.0);
  Tensor gathered = ctx_.empty(Shape{3 * ranks_}, DType::f32);
  world_->all_reduce(x, ReduceOp::sum)->wait();
  world_->barrier();
  world_->broadcast(x, 0)->wait();
  world_->all_gather(x, gathered)->wait();
  EXPECT_EQ(world_->sequence(), 4u);
  try {
    Tensor wrong = ctx_.empty(Shape{3 * ranks_ + 1}, DType::f32);
    world_->all_gather(x, wrong);
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    const std::string what = error.what();
    const std::string rank_part = "rank " + std::to_string(me_) + " of " + std::to_string(ranks_);
    for (const std::string& part :
         std::vector<std::string>{"all_gather", "'world'", rank_part, "operation 5", "size() × input"})
      EXPECT_NE(what.find(part), std::string::npos) << "'" << part << "' missing from: " << what;
  }
  EXPECT_EQ(world_->sequence(), 5u);
}

TEST_F(MpiCommunicatorTest, ArgumentErrorsNameOpCommunicatorAndValue) {
  auto expect_error = [](auto&& call, std::vector<std::string> parts) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one mentioning " << parts[0];
    } catch (const Error& error) {
      const std::string what = error.what();
      for (const auto& part : parts) EXPECT_NE(what.find(part), std::string::npos) << part << " | " << what;
    }
  };
  Tensor f = ctx_.zeros(Shape{4 * ranks_}, DType::f32);
  Tensor small = ctx_.zeros(Shape{3}, DType::f32);
  Tensor h = ctx_.zeros(Shape{4}, DType::bf16);
  expect_error([&] { world_->reduce_scatter(f, small, ReduceOp::sum); },
               {"reduce_scatter", "'world'", "size() × output", std::to_string(4 * ranks_)});
  expect_error([&] { world_->reduce_scatter(f, h, ReduceOp::sum); }, {"reduce_scatter", "f32", "bf16"});
  expect_error([&] { world_->all_gather(h, f); }, {"all_gather", "bf16", "f32"});
  expect_error([&] { world_->broadcast(f, ranks_); },
               {"broadcast", "root " + std::to_string(ranks_) + " is not a rank"});
  expect_error([&] { world_->send(f, -1); }, {"send", "peer -1 is not a rank"});
  expect_error([&] { world_->recv(f, ranks_ + 2); }, {"recv", "peer " + std::to_string(ranks_ + 2)});
  expect_error([&] { world_->send_recv({{P2POp::Kind::recv, f, ranks_}}); }, {"send_recv", "peer"});
  Tensor undefined;
  expect_error([&] { world_->all_reduce(undefined, ReduceOp::sum); }, {"all_reduce", "undefined"});
  expect_error([&] { world_->split(-1, 0, "bad"); }, {"split", "color -1"});
}

TEST_F(MpiCommunicatorTest, SplitGroupsByColourAndOrdersByKey) {
  // Even and odd ranks, each group ordered from its highest world rank down.
  auto group = world_->split(me_ % 2, -me_, "parity");
  std::vector<int> members;
  for (int r = ranks_ - 1; r >= 0; --r)
    if (r % 2 == me_ % 2) members.push_back(r);
  EXPECT_EQ(group->name(), "parity");
  EXPECT_EQ(group->size(), int(members.size()));
  EXPECT_EQ(group->rank(), int(std::find(members.begin(), members.end(), me_) - members.begin()));
  EXPECT_EQ(group->sequence(), 0u);
  const std::vector<int32_t> mine = {me_};
  Tensor gathered = ctx_.empty(Shape{group->size()}, DType::i32);
  group->all_gather(ctx_.from_vector(Shape{1}, mine), gathered)->wait();
  EXPECT_EQ(gathered.to_vector<int32_t>(), std::vector<int32_t>(members.begin(), members.end()));
  Tensor value = ctx_.full(Shape{2}, DType::i64, double(me_));
  group->all_reduce(value, ReduceOp::sum)->wait();
  int64_t sum = 0;
  for (int r : members) sum += r;
  EXPECT_EQ(value.to_vector<int64_t>(), std::vector<int64_t>(2, sum));
}

TEST_F(MpiCommunicatorTest, GroupOfOneIsTheIdentityAndCompleteAtOnce) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  auto self = world_->split(me_, 0, "self");
  ASSERT_EQ(self->size(), 1);
  ASSERT_EQ(self->rank(), 0);
  for (DType dtype : {DType::f32, DType::bf16, DType::i64}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const auto values = random_values(dtype, 19, rng);
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      Tensor t = ctx_.from_doubles(Shape{19}, dtype, values);
      CommHandle work = self->all_reduce(t, op);
      EXPECT_TRUE(work->test());
      EXPECT_TRUE(all_close(t, values, {0, 0}));
      Tensor out = poisoned(ctx_, Shape{19}, dtype);
      EXPECT_TRUE(self->reduce_scatter(t, out, op)->test());
      EXPECT_TRUE(all_close(out, values, {0, 0}));
    }
    Tensor gathered = poisoned(ctx_, Shape{19}, dtype);
    const Tensor input = ctx_.from_doubles(Shape{19}, dtype, values);
    EXPECT_TRUE(self->all_gather(input, gathered)->test());
    EXPECT_TRUE(all_close(gathered, values, {0, 0}));
    Tensor b = ctx_.from_doubles(Shape{19}, dtype, values);
    EXPECT_TRUE(self->broadcast(b, 0)->test());
    EXPECT_TRUE(all_close(b, values, {0, 0}));
    // Point to point with itself goes through MPI and works too.
    Tensor received = poisoned(ctx_, Shape{19}, dtype);
    self->send_recv({{P2POp::Kind::send, input, 0}, {P2POp::Kind::recv, received, 0}})->wait();
    EXPECT_TRUE(all_close(received, values, {0, 0}));
  }
  self->barrier();
  EXPECT_GT(self->sequence(), 0u);
  // Nothing crosses ranks in a group of one: its calls count, its bytes do
  // not (the dp axis at dp 1 showed the whole gradient as traffic every
  // step), while the world counts what it moves.
  const CommCounters& counted = self->counters();
  EXPECT_GT(counted.calls[CommCounters::all_reduce], 0);
  EXPECT_GT(counted.calls[CommCounters::send], 0);
  EXPECT_EQ(counted.total_bytes(), 0);
  world_->reset_counters();
  Tensor moved = ctx_.from_doubles(Shape{19}, DType::f32, random_values(DType::f32, 19, rng));
  world_->all_reduce(moved, ReduceOp::sum)->wait();
  EXPECT_EQ(world_->counters().bytes[CommCounters::all_reduce], 19 * 4);
}

TEST_F(MpiCommunicatorTest, PollCompletesOutstandingOperations) {
  parallel::MpiCommunicator comm(MPI_COMM_WORLD, "polled");
  std::vector<Tensor> tensors;
  std::vector<CommHandle> works;
  for (int i = 0; i < 3; ++i) {
    tensors.push_back(ctx_.full(Shape{(1 << 16) + i}, DType::f32, double(me_ + i)));
    works.push_back(comm.all_reduce(tensors.back(), ReduceOp::sum));
  }
  EXPECT_EQ(comm.outstanding(), ranks_ > 1 ? 3u : 0u);  // a group of one completes at once
  // No wait(): poll() alone must drive them to completion.
  for (long spins = 0; comm.outstanding() > 0 && spins < 50'000'000; ++spins) comm.poll();
  EXPECT_EQ(comm.outstanding(), 0u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(works[size_t(i)]->test());
    const double expected = double(ranks_) * (ranks_ - 1) / 2 + double(ranks_) * i;
    EXPECT_TRUE(all_close(tensors[size_t(i)], std::vector<double>(size_t((1 << 16) + i), expected), {0, 0}));
  }
}

TEST_F(MpiCommunicatorTest, DroppedHandleAndDestroyedCommunicatorStillComplete) {
  Tensor dropped = ctx_.full(Shape{1000}, DType::i32, double(me_ + 1));
  Tensor kept = ctx_.full(Shape{1000}, DType::i32, double(me_ + 1));
  CommHandle survivor;
  {
    parallel::MpiCommunicator comm(MPI_COMM_WORLD, "short-lived");
    comm.all_reduce(dropped, ReduceOp::sum).reset();  // destroying the handle waits
    EXPECT_EQ(comm.outstanding(), 0u);
    survivor = comm.all_reduce(kept, ReduceOp::max);
  }  // the communicator finishes what is in flight before it goes
  EXPECT_TRUE(survivor->test());
  survivor->wait();
  EXPECT_EQ(dropped.to_vector<int32_t>(), std::vector<int32_t>(1000, ranks_ * (ranks_ + 1) / 2));
  EXPECT_EQ(kept.to_vector<int32_t>(), std::vector<int32_t>(1000, ranks_));
}

// Device tensors through MPI alone (--comm-backend mpi, or no NCCL): staged
// through pinned host memory. On the emulated device always, on a GPU where
// there is one.
TEST_F(MpiCommunicatorTest, DeviceTensorsAreStagedThroughTheHost) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  std::vector<Device> devices = {Device::emulated(mpi_env().local_rank() % emulated::kDeviceCount)};
  if (gpu_available(ctx_)) devices.push_back(Device::cuda(mpi_env().local_rank() % ctx_.cuda_device_count()));
  for (const Device gpu : devices) {
    SCOPED_TRACE(gpu.to_string());
    bind_thread_to_device(gpu);
    for (DType dtype : {DType::f32, DType::bf16}) {
      const auto inputs = every_ranks_values(dtype, 333, ranks_, rng);
      Tensor tensor = ctx_.from_doubles(Shape{333}, dtype, inputs[size_t(me_)], gpu);
      world_->all_reduce(tensor, ReduceOp::avg)->wait();
      std::vector<double> expected(333);
      for (size_t i = 0; i < expected.size(); ++i) expected[i] = reduce_reference(dtype, ReduceOp::avg, inputs, i);
      EXPECT_TRUE(all_close(tensor, expected, exact_for(ranks_)));
      Tensor gathered = poisoned(ctx_, Shape{333 * ranks_}, dtype, gpu);
      world_->all_gather(ctx_.from_doubles(Shape{333}, dtype, inputs[size_t(me_)], gpu), gathered)->wait();
      std::vector<double> all;
      for (const auto& in : inputs) all.insert(all.end(), in.begin(), in.end());
      EXPECT_TRUE(all_close(gathered, all, {0, 0}));
    }
  }
}

// ---------------------------------------------------------------------------
// Choosing the backend; NCCL (runs only where every rank has a GPU).

TEST(CommBackend, ParsesTheFlagValues) {
  EXPECT_EQ(parallel::parse_comm_backend("auto"), parallel::CommBackend::automatic);
  EXPECT_EQ(parallel::parse_comm_backend("mpi"), parallel::CommBackend::mpi);
  EXPECT_EQ(parallel::parse_comm_backend("nccl"), parallel::CommBackend::nccl);
  for (auto backend : {parallel::CommBackend::automatic, parallel::CommBackend::mpi, parallel::CommBackend::nccl})
    EXPECT_EQ(parallel::parse_comm_backend(parallel::comm_backend_name(backend)), backend);
  try {
    parallel::parse_comm_backend("gloo");
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("--comm-backend 'gloo'"), std::string::npos) << error.what();
  }
}

TEST(CommBackend, HostDevicesGetMpiAndNcclNeedsACudaDevice) {
  Context ctx;
  for (auto backend : {parallel::CommBackend::automatic, parallel::CommBackend::mpi}) {
    auto comm = parallel::make_communicator(MPI_COMM_WORLD, "made", ctx, Device::cpu(), backend);
    EXPECT_NE(dynamic_cast<parallel::MpiCommunicator*>(comm.get()), nullptr);
    Tensor x = ctx.full(Shape{3}, DType::f32, 1.0);
    comm->all_reduce(x, ReduceOp::sum)->wait();
    EXPECT_EQ(x.to_vector<float>(), std::vector<float>(3, float(comm->size())));
  }
  // Refused before any collective, on every rank alike.
  try {
    parallel::make_communicator(MPI_COMM_WORLD, "made", ctx, Device::cpu(), parallel::CommBackend::nccl);
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("--comm-backend nccl"), std::string::npos) << what;
  }
}

// The device channels: NCCL on CUDA devices, the emulated channel on emu:N,
// both behind the same stream communicator (parallel/stream_communicator.h).
// Each rank takes its node-local rank's device. NCCL does not support two
// ranks on one GPU, so the CUDA case runs only where every rank of the node
// has a GPU of its own and says why it is skipped otherwise; the emulated case
// runs everywhere.
class DeviceChannel : public ::testing::TestWithParam<DeviceType> {
 protected:
  void SetUp() override {
    const int local = mpi_env().local_rank(), ranks_here = mpi_env().local_size();
    if (GetParam() == DeviceType::emulated) {
      device_ = Device::emulated(local % emulated::kDeviceCount);
    } else if (!gpu_available(ctx_)) {
      GTEST_SKIP() << no_gpu_reason();
    } else if (ctx_.cuda_device_count() < ranks_here) {
      GTEST_SKIP() << "skipped: NCCL needs one GPU per rank, and this node runs " << ranks_here << " ranks on "
                   << ctx_.cuda_device_count() << " GPU(s); run with at most " << ctx_.cuda_device_count()
                   << " ranks per node";
    } else {
      device_ = Device::cuda(local);
    }
    bind_thread_to_device(device_);
  }

  Context ctx_;
  Device device_;  // this rank's: its node-local rank's device
};

std::string device_type_name(const ::testing::TestParamInfo<DeviceType>& info) {
  return info.param == DeviceType::cuda ? "Nccl" : "Emulated";
}

// NCCL reduces in the element type (bf16/f16 partial sums are rounded) and
// its avg may pre-scale: tolerances, not exact references, for floats.
Tolerance nccl_tolerance(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return {1e-6, 1e-6};
    case DType::bf16:
      return {2e-2, 1e-2};
    case DType::f16:
      return {4e-3, 1e-3};
    default:
      return {0, 0};
  }
}

TEST_P(DeviceChannel, EveryCollectiveOnTheDevice) {
  Context& ctx = ctx_;
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  auto comm = parallel::make_device_communicator(MPI_COMM_WORLD, "nccl", ctx, device_);
  EXPECT_NE(dynamic_cast<parallel::StreamCommunicator*>(comm.get()), nullptr);
  const int ranks = comm->size(), me = comm->rank();
  for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      if (dtype == DType::u8 && op == ReduceOp::avg) continue;  // NCCL divides the wrapped u8 sum
      const auto inputs = every_ranks_values(dtype, 1001, ranks, rng);
      Tensor t = ctx.from_doubles(Shape{1001}, dtype, inputs[size_t(me)], device_);
      comm->all_reduce(t, op)->wait();
      std::vector<double> expected(1001);
      for (size_t i = 0; i < expected.size(); ++i) expected[i] = reduce_reference(dtype, op, inputs, i);
      EXPECT_TRUE(all_close(t, expected, nccl_tolerance(dtype))) << op_name(op);
      const auto blocks = every_ranks_values(dtype, 37 * ranks, ranks, rng);
      Tensor out = poisoned(ctx, Shape{37}, dtype, device_);
      comm->reduce_scatter(ctx.from_doubles(Shape{37 * ranks}, dtype, blocks[size_t(me)], device_), out, op)->wait();
      std::vector<double> block(37);
      for (size_t i = 0; i < block.size(); ++i) block[i] = reduce_reference(dtype, op, blocks, size_t(me * 37) + i);
      EXPECT_TRUE(all_close(out, block, nccl_tolerance(dtype))) << "reduce_scatter " << op_name(op);
    }
    const auto inputs = every_ranks_values(dtype, 53, ranks, rng);
    Tensor gathered = poisoned(ctx, Shape{53 * ranks}, dtype, device_);
    comm->all_gather(ctx.from_doubles(Shape{53}, dtype, inputs[size_t(me)], device_), gathered)->wait();
    std::vector<double> all;
    for (const auto& in : inputs) all.insert(all.end(), in.begin(), in.end());
    EXPECT_TRUE(all_close(gathered, all, {0, 0}));
    Tensor b = me == ranks - 1 ? ctx.from_doubles(Shape{53}, dtype, inputs[size_t(me)], device_)
                               : poisoned(ctx, Shape{53}, dtype, device_);
    comm->broadcast(b, ranks - 1)->wait();
    EXPECT_TRUE(all_close(b, inputs[size_t(ranks - 1)], {0, 0}));
    const int next = (me + 1) % ranks, previous = (me + ranks - 1) % ranks;
    Tensor incoming = poisoned(ctx, Shape{53}, dtype, device_);
    comm->send_recv({{P2POp::Kind::send, ctx.from_doubles(Shape{53}, dtype, inputs[size_t(me)], device_), next},
                     {P2POp::Kind::recv, incoming, previous}})
        ->wait();
    EXPECT_TRUE(all_close(incoming, inputs[size_t(previous)], {0, 0}));
  }
  comm->barrier();
  auto halves = comm->split(me % 2, me, "nccl-half");
  Tensor one = ctx.full(Shape{5}, DType::i32, 1.0, device_);
  halves->all_reduce(one, ReduceOp::sum)->wait();
  EXPECT_EQ(one.to_vector<int32_t>(), std::vector<int32_t>(5, halves->size()));
}

// Several operations in flight at once, tested and waited out of order: the
// handles, events and the watchdog's bookkeeping of a stream communicator.
TEST_P(DeviceChannel, OperationsInFlightCompleteInAnyOrder) {
  Context& ctx = ctx_;
  auto comm = parallel::make_device_communicator(MPI_COMM_WORLD, "inflight", ctx, device_);
  comm->set_timeout(120);
  const int ranks = comm->size();
  std::vector<Tensor> tensors;
  std::vector<CommHandle> handles;
  for (int i = 0; i < 6; ++i) {
    tensors.push_back(ctx.full(Shape{1000 + i * 4096}, DType::f32, double(i + 1), device_));
    handles.push_back(comm->all_reduce(tensors.back(), ReduceOp::sum));
  }
  while (!handles[5]->test()) std::this_thread::sleep_for(std::chrono::microseconds(100));
  for (int i = 5; i >= 0; --i) handles[size_t(i)]->wait();
  for (int i = 0; i < 6; ++i)
    EXPECT_EQ(tensors[size_t(i)].to_vector<float>(),
              std::vector<float>(size_t(1000 + i * 4096), float((i + 1) * ranks)));
}

TEST_P(DeviceChannel, AutomaticRoutesByTheTensorsDevice) {
  Context& ctx = ctx_;
  auto comm = parallel::make_communicator(MPI_COMM_WORLD, "auto", ctx, device_);
  const int ranks = comm->size();
  Tensor on_device = ctx.full(Shape{7}, DType::f32, 2.0, device_);
  Tensor on_host = ctx.full(Shape{7}, DType::f32, 3.0);
  comm->all_reduce(on_device, ReduceOp::sum)->wait();
  comm->all_reduce(on_host, ReduceOp::sum)->wait();
  EXPECT_EQ(on_device.to_vector<float>(), std::vector<float>(7, 2.0f * float(ranks)));
  EXPECT_EQ(on_host.to_vector<float>(), std::vector<float>(7, 3.0f * float(ranks)));
  EXPECT_EQ(comm->sequence(), 2u);
}

// A rank that throws with an operation in flight (its peer never joins it)
// tears its communicator down at once: abort, not finalize, which would wait
// for the peer. Rank 0 enqueues an all-reduce that rank 1 never enqueues and
// throws; then both pass a host barrier, which rank 0 reaches only if its
// teardown returned.
TEST_P(DeviceChannel, ARankThatThrowsWithAnOperationInFlightTearsDownWithoutWaiting) {
  Context& ctx = ctx_;
  std::unique_ptr<Communicator> host = parallel::make_mpi_communicator(MPI_COMM_WORLD, "host");
  host->set_timeout(120);
  const int me = host->rank();
  bool threw = false;
  try {
    auto comm = parallel::make_device_communicator(MPI_COMM_WORLD, "doomed", ctx, device_);
    comm->set_timeout(600);  // the watchdog must not be what ends it
    Tensor t = ctx.full(Shape{1 << 16}, DType::f32, 1.0, device_);
    CommHandle pending;
    if (me == 0) pending = comm->all_reduce(t, ReduceOp::sum);
    host->barrier();
    if (me == 0) {
      (void)pending.release();  // an operation that will never finish, left in flight
      throw std::runtime_error("rank 0 failed mid-step");
    }
  } catch (const std::runtime_error&) {
    threw = true;
  }
  EXPECT_EQ(threw, me == 0);
  host->barrier();
}

INSTANTIATE_TEST_SUITE_P(Kinds, DeviceChannel, ::testing::Values(DeviceType::cuda, DeviceType::emulated),
                         device_type_name);

// ---------------------------------------------------------------------------

TEST(MpiEnv, LayoutIsConsistentAcrossRanks) {
  const parallel::MpiEnv& env = mpi_env();
  int rank = -1, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(env.world_rank(), rank);
  EXPECT_EQ(env.world_size(), size);
  EXPECT_EQ(env.is_root(), rank == 0);
  EXPECT_FALSE(env.hostname().empty());
  // Every rank's (node, local rank, local size): each node's local ranks are
  // 0..local_size-1, nodes are numbered 0..node_count-1 by their lowest rank.
  const int mine[3] = {env.node_index(), env.local_rank(), env.local_size()};
  std::vector<int> all(static_cast<size_t>(3 * size));
  MPI_Allgather(mine, 3, MPI_INT, all.data(), 3, MPI_INT, MPI_COMM_WORLD);
  std::vector<std::vector<int>> local_ranks(size_t(env.node_count()));
  int next_node = 0;
  for (int r = 0; r < size; ++r) {
    const int node = all[size_t(3 * r)];
    const bool valid = node >= 0 && node < env.node_count();
    EXPECT_TRUE(valid) << "rank " << r << " on node " << node << " of " << env.node_count();
    if (!valid) continue;                // EXPECT, not ASSERT: describe_layout() below is collective
    if (node == next_node) ++next_node;  // first seen in rank order
    EXPECT_LT(node, next_node) << "nodes are numbered by their lowest rank";
    local_ranks[size_t(node)].push_back(all[size_t(3 * r + 1)]);
  }
  for (size_t node = 0; node < local_ranks.size(); ++node) {
    auto sorted = local_ranks[node];
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < sorted.size(); ++i) EXPECT_EQ(sorted[i], int(i)) << "node " << node;
    for (int r = 0; r < size; ++r)
      if (all[size_t(3 * r)] == int(node)) {
        EXPECT_EQ(all[size_t(3 * r + 2)], int(sorted.size()));
      }
  }
  const std::string layout = env.describe_layout();
  EXPECT_NE(layout.find("world " + std::to_string(size) + " rank"), std::string::npos) << layout;
  EXPECT_NE(layout.find(env.hostname()), std::string::npos) << layout;
}

TEST(MpiEnv, DefaultDeviceFollowsTheLocalRank) {
  const parallel::MpiEnv& env = mpi_env();
  EXPECT_EQ(env.default_device(false, 4), Device::cpu());
  EXPECT_EQ(env.default_device(true, 3), Device::cuda(env.local_rank() % 3));
  try {
    env.default_device(true, 0);
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("--device cpu"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace tessera::testing
