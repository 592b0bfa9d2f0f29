// Context parallelism's compute and communication core: a sequence of T
// tokens split over a cp group of C ranks, and causal attention over the
// whole sequence computed by passing key/value blocks around the group (ring
// attention). Not wired into the models yet (issue 32): a model layer holds
// its rank's tokens, projects them, and calls RingAttention where a
// single-rank layer calls ops::grouped_attention_*.
//
// The split (zigzag, Megatron-Core's and torchtitan's load-balanced causal
// sharding): the sequence is cut into 2C equal chunks and rank r holds chunks
// r and 2C − 1 − r, in that order. Every rank then has the same causal work:
// an early chunk (few keys before it) with a late one (many).
//
// The ring, forward: rank r starts with its own key/value block; at step i
// (0 ≤ i < C) it holds the block of rank (r − i) mod C. Before computing on
// that block it starts the exchange of the next one (send its block to rank
// r + 1, receive rank r − 1's, one grouped send_recv), so the transfer runs
// beside the compute; each block's partial attention
// (ops::attention_block_forward, f32) is merged into the running result by
// the log-sum-exp rule (ops::attention_block_merge). C − 1 exchanges.
//
// The ring, backward (flash attention's, block by block, from the final out
// and logsumexp): the key/value blocks travel as in the forward, started
// before the compute; with each block travels its gradient accumulator
// dKV [B, Tk, G, 2, Dh] f32, which every rank adds its queries' terms to:
// a rank computes its block terms into a local buffer while the accumulator
// arrives, then adds and passes it on. After C steps the accumulator of block
// j has every rank's terms and sits on rank j − 1, which sends it home (C
// exchanges of the accumulator). dQ stays local.
//
// The causal shortcut: a block whose every key lies after every local query
// (min key position > max query position) is not computed; it still moves.
// With the zigzag split no whole block is in the future (a later rank's
// block is half visible to the late chunk), so the shortcut serves other
// splits (e.g. contiguous ones, which RingAttention also takes); the block
// kernels skip invisible keys row by row.
//
// Backends: whatever the Communicator abstracts (MPI on host tensors, NCCL or
// the emulated device's channel on device tensors): blocks and accumulators
// are ordinary tensors on q's device, exchanged with send_recv.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "parallel/communicator.h"

namespace tessera::parallel {

// Rank `rank` of `size`'s share of a sequence of `seq_length` tokens under the
// zigzag split: two chunks of `chunk_length` tokens starting at first_begin
// (chunk rank) and second_begin (chunk 2·size − 1 − rank).
struct ZigzagShard {
  int64_t chunk_length, first_begin, second_begin;

  // The global positions held, in local order: [first_begin, first_begin + chunk_length)
  // then [second_begin, second_begin + chunk_length).
  std::vector<int64_t> positions() const;
};

// Refuses a sequence that does not split into 2·size equal chunks, naming
// --seq-length and --context-parallel-size.
ZigzagShard zigzag_shard(int64_t seq_length, int rank, int size);

// Every rank's positions of a sequence of `seq_length` under the zigzag split.
std::vector<std::vector<int64_t>> zigzag_positions(int64_t seq_length, int size);

// Causal attention over a sequence split over `group` (the cp group).
// Tensors (on one device, q's dtype f32/bf16/f16 unless said):
//   q [B, Tl, H, Dh]: this rank's queries, query head h = g·R + j of key/value head g;
//   kv [B, Tl, G, 2, Dh]: this rank's keys and values (per key/value head its key then its value);
//   out [B, Tl, H, Dh] (q's dtype); logsumexp [B, H, Tl] f32 (kept for the backward);
//   grad_q [B, Tl, H, Dh], grad_kv [B, Tl, G, 2, Dh]: f32 or q's dtype (accumulated in f32).
// Tl is the number of positions each rank holds (the same on every rank).
// Each step's block compute, exchanges and blocking waits go to the group's
// GroupEvents when it has them (a trace: "ring forward block", "ring forward
// exchange", "ring forward wait", the same for backward, whose gradient
// accumulators travel as "ring backward gradient exchange").
class RingAttention {
 public:
  // positions[r]: the global positions rank r of `group` holds, in its local
  // order (zigzag_positions, or any split with equal counts per rank);
  // scale as ops::attention_block_forward's (≤ 0: 1/√Dh).
  RingAttention(Communicator& group, std::vector<std::vector<int64_t>> positions, float scale = 0.0f);

  // out and logsumexp of this rank's queries over the whole sequence.
  void forward(const Tensor& q, const Tensor& kv, Tensor& out, Tensor& logsumexp);
  // grad_q and grad_kv (written, not added to) of this rank's queries and
  // keys/values, from the forward's out and logsumexp.
  void backward(const Tensor& grad_out, const Tensor& q, const Tensor& kv, const Tensor& out, const Tensor& logsumexp,
                Tensor& grad_q, Tensor& grad_kv);

  // Blocks computed and skipped (the causal shortcut) by this rank so far,
  // forward and backward together.
  struct Counts {
    int64_t computed = 0, skipped = 0;
  };
  const Counts& counts() const { return counts_; }

 private:
  int source_of_step(int step) const;                         // whose block this rank holds at `step`
  bool visible(int source) const;                             // whether any key of `source`'s block is seen here
  Tensor positions_on(int source, const Tensor& like) const;  // positions[source], i64 on like's device
  void check_shapes(const Tensor& q, const Tensor& kv) const;

  Communicator& group_;
  std::vector<std::vector<int64_t>> positions_;
  float scale_;
  Counts counts_;
};

// A model layer's side of the ring: its projections qkv (this rank's
// zigzag tokens, GPT-2's [B, Tl, 3, H, Dh] or grouped [B, Tl, G, R + 2, Dh])
// → out [B, Tl, H, Dh] attended over the whole sequence of Tl·C tokens, and
// the gradient of out back to one of qkv's shape (ops::split_qkv / join_qkv
// around RingAttention). What the backward needs ({q, kv, out, logsumexp})
// is appended to `saved` (a layer's nn::Saved::tensors); the backward reads
// it from the front of `saved` and writes a gradient of shape `qkv_shape`.
Tensor ring_attention_forward(Communicator& group, const Tensor& qkv, bool grouped, std::vector<Tensor>& saved);
Tensor ring_attention_backward(Communicator& group, const Tensor& grad_out, bool grouped, const Shape& qkv_shape,
                               const std::vector<Tensor>& saved);
// The global positions this rank of `group` holds of sequences split into
// zigzag shares of `local_tokens` tokens, as a list and as a tensor (i64 on `device`).
std::vector<int64_t> context_share(Communicator& group, int64_t local_tokens);
Tensor context_positions(Communicator& group, int64_t local_tokens, Context& context, Device device);

}  // namespace tessera::parallel
