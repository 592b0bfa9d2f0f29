// Ring attention over a cp group (see ring_attention.h): the zigzag split of
// a sequence, and the forward and backward rings built from the block
// operators of kernels/ops.h (ops::attention_block_*) and send_recv.
#include "parallel/ring_attention.h"

#include <algorithm>
#include <string>
#include <utility>

#include "core/context.h"
#include "core/error.h"
#include "kernels/ops.h"

namespace tessera::parallel {

std::vector<int64_t> ZigzagShard::positions() const {
  std::vector<int64_t> held;
  held.reserve(size_t(2 * chunk_length));
  for (const int64_t begin : {first_begin, second_begin})
    for (int64_t p = begin; p < begin + chunk_length; ++p) held.push_back(p);
  return held;
}

ZigzagShard zigzag_shard(int64_t seq_length, int rank, int size) {
  TESSERA_CHECK(size >= 1 && rank >= 0 && rank < size, "context parallelism: rank ", rank,
                " is not in a group of --context-parallel-size ", size);
  const int64_t chunks = 2 * int64_t(size);
  TESSERA_CHECK(seq_length > 0 && seq_length % chunks == 0, "context parallelism: --seq-length ", seq_length,
                " does not split into 2 × --context-parallel-size = ", chunks,
                " equal chunks (each rank holds two, for balanced causal work); make --seq-length a multiple of ",
                chunks, " or change --context-parallel-size");
  const int64_t chunk = seq_length / chunks;
  return ZigzagShard{chunk, rank * chunk, (chunks - 1 - rank) * chunk};
}

std::vector<std::vector<int64_t>> zigzag_positions(int64_t seq_length, int size) {
  std::vector<std::vector<int64_t>> positions;
  for (int rank = 0; rank < size; ++rank) positions.push_back(zigzag_shard(seq_length, rank, size).positions());
  return positions;
}

namespace {

// Sends `outgoing` to the next rank of the ring and receives `incoming` from
// the previous one, as one grouped exchange (no deadlock whatever the order).
CommHandle pass_along(Communicator& group, const Tensor& outgoing, Tensor& incoming) {
  const int size = group.size(), next = (group.rank() + 1) % size, previous = (group.rank() + size - 1) % size;
  return group.send_recv({P2POp{P2POp::Kind::send, outgoing, next}, P2POp{P2POp::Kind::recv, incoming, previous}});
}

// The key/value block a rank holds at each step: its own at step 0, then the
// one received during step i − 1 in buffers[(i − 1) % 2]; step i receives into
// buffers[i % 2] (the one sent at step i − 1 is free again by then).
class BlockRing {
 public:
  BlockRing(const Tensor& own, int size) : own_(own) {
    if (size > 1)
      for (Tensor& buffer : buffers_) buffer = own.context().empty(own.shape(), own.dtype(), own.device());
  }
  const Tensor& current(int step) const { return step == 0 ? own_ : buffers_[(step - 1) % 2]; }
  Tensor& incoming(int step) { return buffers_[step % 2]; }

 private:
  const Tensor& own_;
  Tensor buffers_[2];
};

// `result` itself when it is f32 (the accumulator is written in place), else
// a new f32 tensor of its shape to cast into it at the end (finish_into).
Tensor f32_accumulator(Tensor& result) {
  if (result.dtype() == DType::f32) return result;
  return result.context().empty(result.shape(), DType::f32, result.device());
}
void finish_into(const Tensor& accumulator, Tensor& result) {
  if (accumulator.data_ptr() == result.data_ptr()) return;
  if (result.dtype() == DType::f32)
    result.copy_(accumulator);
  else
    ops::cast(accumulator, result);
}

// The ring's timeline for a trace (the group's GroupEvents; nothing is read
// or recorded when it has none): each block's compute ("ring forward block",
// category compute), each exchange from its launch until it was seen
// complete ("ring forward exchange", comm: the first test after the block's
// compute, or the end of the wait), and each wait that blocked ("ring
// forward wait", comm): the exposed part of the exchange. An exchange that
// finished while the block computed shows no wait; the exposed share is the
// waits' time over the exchanges'.
class RingTimeline {
 public:
  RingTimeline(const GroupEvents& events, std::string pass) : events_(events), pass_("ring " + std::move(pass)) {}

  int64_t now() const { return events_.enabled() ? events_.clock() : 0; }

  template <typename Compute>
  void block(Compute&& compute) {
    const int64_t start = now();
    compute();
    if (events_.enabled()) events_.record(pass_ + " block", "compute", start, now());
  }

  // Waits for `exchange` (launched at `launched` by now()), named `what`.
  void finish(CommWork& exchange, int64_t launched, const std::string& what = "exchange") {
    if (!events_.enabled()) return exchange.wait();
    if (exchange.test()) return events_.record(pass_ + " " + what, "comm", launched, now());
    const int64_t waiting = now();
    exchange.wait();
    const int64_t done = now();
    events_.record(pass_ + " wait", "comm", waiting, done);
    events_.record(pass_ + " " + what, "comm", launched, done);
  }

 private:
  const GroupEvents& events_;
  std::string pass_;
};

}  // namespace

RingAttention::RingAttention(Communicator& group, std::vector<std::vector<int64_t>> positions, float scale)
    : group_(group), positions_(std::move(positions)), scale_(scale) {
  TESSERA_CHECK(int(positions_.size()) == group_.size(), "RingAttention: positions for ", positions_.size(),
                " ranks, but the cp group '", group_.name(), "' has ", group_.size());
  for (size_t r = 0; r < positions_.size(); ++r)
    TESSERA_CHECK(!positions_[r].empty() && positions_[r].size() == positions_[0].size(), "RingAttention: rank ", r,
                  " of the cp group holds ", positions_[r].size(), " positions and rank 0 holds ", positions_[0].size(),
                  "; every rank must hold the same number (split the sequence with zigzag_positions)");
}

int RingAttention::source_of_step(int step) const {
  const int size = group_.size();
  return (group_.rank() - step % size + size) % size;
}

bool RingAttention::visible(int source) const {
  const std::vector<int64_t>& queries = positions_[size_t(group_.rank())];
  const std::vector<int64_t>& keys = positions_[size_t(source)];
  return *std::min_element(keys.begin(), keys.end()) <= *std::max_element(queries.begin(), queries.end());
}

Tensor RingAttention::positions_on(int source, const Tensor& like) const {
  const std::vector<int64_t>& held = positions_[size_t(source)];
  return like.context().from_vector(Shape{int64_t(held.size())}, held, like.device());
}

void RingAttention::check_shapes(const Tensor& q, const Tensor& kv) const {
  const int64_t held = int64_t(positions_[size_t(group_.rank())].size());
  TESSERA_CHECK(q.ndim() == 4 && kv.ndim() == 5 && q.size(1) == held && kv.size(1) == held, "RingAttention: rank ",
                group_.rank(), " of the cp group holds ", held, " positions, so q must be [B, ", held,
                ", H, Dh] and kv [B, ", held, ", G, 2, Dh]; got q ", q.shape().to_string(), " and kv ",
                kv.shape().to_string());
}

void RingAttention::forward(const Tensor& q, const Tensor& kv, Tensor& out, Tensor& logsumexp) {
  check_shapes(q, kv);
  const int size = group_.size();
  const Tensor q_positions = positions_on(group_.rank(), q);
  Tensor running = f32_accumulator(out);
  Tensor block_out = q.context().empty(out.shape(), DType::f32, q.device());
  Tensor block_logsumexp = q.context().empty(logsumexp.shape(), DType::f32, q.device());
  BlockRing blocks(kv, size);
  RingTimeline timeline(group_.events(), "forward");
  for (int step = 0; step < size; ++step) {
    CommHandle exchange;
    const int64_t launched = timeline.now();
    if (step + 1 < size) exchange = pass_along(group_, blocks.current(step), blocks.incoming(step));
    const int source = source_of_step(step);
    if (step == 0) {  // the own block starts the running result (every query sees itself)
      timeline.block([&] { ops::attention_block_forward(q, kv, q_positions, q_positions, running, logsumexp, scale_); });
      ++counts_.computed;
    } else if (visible(source)) {
      timeline.block([&] {
        ops::attention_block_forward(q, blocks.current(step), q_positions, positions_on(source, q), block_out,
                                     block_logsumexp, scale_);
        ops::attention_block_merge(block_out, block_logsumexp, running, logsumexp);
      });
      ++counts_.computed;
    } else {
      ++counts_.skipped;
    }
    if (exchange) timeline.finish(*exchange, launched);
  }
  finish_into(running, out);
}

void RingAttention::backward(const Tensor& grad_out, const Tensor& q, const Tensor& kv, const Tensor& out,
                             const Tensor& logsumexp, Tensor& grad_q, Tensor& grad_kv) {
  check_shapes(q, kv);
  const int size = group_.size();
  const Tensor q_positions = positions_on(group_.rank(), q);
  Tensor dq = f32_accumulator(grad_q);
  dq.fill_(0.0);
  // The accumulator of the block held at step i is accumulators[i % 2]: at
  // step 0 this rank's own, then the one received from the previous rank.
  Tensor accumulators[2], terms;
  for (Tensor& a : accumulators) a = q.context().empty(kv.shape(), DType::f32, q.device());
  if (size > 1) terms = q.context().empty(kv.shape(), DType::f32, q.device());
  accumulators[0].fill_(0.0);
  BlockRing blocks(kv, size);
  RingTimeline timeline(group_.events(), "backward");
  CommHandle arriving;  // the accumulator for the next step
  int64_t arriving_launched = 0;
  for (int step = 0; step < size; ++step) {
    CommHandle exchange;
    const int64_t launched = timeline.now();
    if (step + 1 < size) exchange = pass_along(group_, blocks.current(step), blocks.incoming(step));
    const int source = source_of_step(step);
    Tensor& accumulator = accumulators[step % 2];
    const bool compute = step == 0 || visible(source);
    if (compute) {
      Tensor& into = step == 0 ? accumulator : terms.fill_(0.0);
      timeline.block([&] {
        ops::attention_block_backward(grad_out, q, blocks.current(step), out, logsumexp, q_positions,
                                      positions_on(source, q), dq, into, scale_);
      });
    }
    ++(compute ? counts_.computed : counts_.skipped);
    if (arriving) timeline.finish(*arriving, arriving_launched, "gradient exchange");
    if (step > 0 && compute) ops::axpy(1.0f, terms, accumulator);
    // Passed on; after the last step it goes home, to the rank after this one.
    arriving_launched = timeline.now();
    if (size > 1) arriving = pass_along(group_, accumulator, accumulators[(step + 1) % 2]);
    if (exchange) timeline.finish(*exchange, launched);
  }
  if (arriving) timeline.finish(*arriving, arriving_launched, "gradient exchange");
  finish_into(accumulators[size > 1 ? size % 2 : 0], grad_kv);  // the own block's, home from the previous rank
  finish_into(dq, grad_q);
}

std::vector<int64_t> context_share(Communicator& group, int64_t local_tokens) {
  return zigzag_shard(local_tokens * group.size(), group.rank(), group.size()).positions();
}

Tensor context_positions(Communicator& group, int64_t local_tokens, Context& context, Device device) {
  const std::vector<int64_t> held = context_share(group, local_tokens);
  return context.from_vector(Shape{int64_t(held.size())}, held, device);
}

Tensor ring_attention_forward(Communicator& group, const Tensor& qkv, bool grouped, std::vector<Tensor>& saved) {
  TESSERA_CHECK(qkv.ndim() == 5, "ring attention: the projections must be 5-dimensional, got ",
                qkv.shape().to_string());
  const int64_t batch = qkv.size(0), tokens = qkv.size(1), head_dim = qkv.size(4);
  const int64_t groups = grouped ? qkv.size(2) : qkv.size(3), heads = grouped ? groups * (qkv.size(3) - 2) : groups;
  Context& context = qkv.context();
  Tensor q = context.empty(Shape{batch, tokens, heads, head_dim}, qkv.dtype(), qkv.device());
  Tensor kv = context.empty(Shape{batch, tokens, groups, 2, head_dim}, qkv.dtype(), qkv.device());
  ops::split_qkv(qkv, grouped, q, kv);
  Tensor out = context.empty(q.shape(), qkv.dtype(), qkv.device());
  Tensor logsumexp = context.empty(Shape{batch, heads, tokens}, DType::f32, qkv.device());
  RingAttention(group, zigzag_positions(tokens * group.size(), group.size())).forward(q, kv, out, logsumexp);
  saved.insert(saved.end(), {q, kv, out, logsumexp});
  return out;
}

Tensor ring_attention_backward(Communicator& group, const Tensor& grad_out, bool grouped, const Shape& qkv_shape,
                               const std::vector<Tensor>& saved) {
  TESSERA_CHECK(saved.size() >= 4, "ring attention: backward without a matching forward");
  const Tensor &q = saved[0], &kv = saved[1], &out = saved[2], &logsumexp = saved[3];
  Context& context = grad_out.context();
  Tensor grad_q = context.empty(q.shape(), DType::f32, q.device());
  Tensor grad_kv = context.empty(kv.shape(), DType::f32, q.device());
  RingAttention(group, zigzag_positions(q.size(1) * group.size(), group.size()))
      .backward(grad_out.view(out.shape()), q, kv, out, logsumexp, grad_q, grad_kv);
  Tensor grad_qkv = context.empty(qkv_shape, q.dtype(), q.device());
  ops::join_qkv(grad_q, grad_kv, grouped, grad_qkv);
  return grad_qkv;
}

}  // namespace tessera::parallel
