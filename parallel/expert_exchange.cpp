// ExpertExchange (see expert_exchange.h): the counts, the rows' all-to-all
// and the regrouping into each local expert's contiguous rows, and back.
#include "parallel/expert_exchange.h"

#include "core/context.h"
#include "core/error.h"
#include "kernels/ops.h"

namespace tessera::parallel {
namespace {

// Elements per rank from rows per rank.
std::vector<int64_t> elements(const std::vector<int64_t>& rows, int64_t width) {
  std::vector<int64_t> out;
  for (const int64_t r : rows) out.push_back(r * width);
  return out;
}

// `rows` of `source` gathered by `order` (one row per index): ops::moe_permute with one choice per row.
Tensor gather_rows(const Tensor& source, const Tensor& order) {
  Tensor out = source.context().empty(Shape{order.size(0), source.size(1)}, source.dtype(), source.device());
  if (order.size(0) > 0) ops::moe_permute(source, order, 1, out);
  return out;
}

// One exchange's span on the group's timeline ("expert dispatch", "expert
// combine"), recorded when a trace asks for it (Communicator::set_events).
class ExchangeSpan {
 public:
  ExchangeSpan(const GroupEvents& events, const char* name)
      : events_(events), name_(name), start_(events.enabled() ? events.clock() : 0) {}
  void end() const {
    if (events_.enabled()) events_.record(name_, "comm", start_, events_.clock());
  }

 private:
  const GroupEvents& events_;
  const char* name_;
  int64_t start_;
};

}  // namespace

ExpertExchange::ExpertExchange(Communicator& group, int64_t num_experts)
    : group_(group), num_experts_(num_experts), local_experts_(num_experts / group.size()) {
  TESSERA_CHECK(num_experts >= 1 && num_experts % group.size() == 0, "expert parallelism: --num-experts ", num_experts,
                " does not split over --expert-model-parallel-size ", group.size(),
                " (each rank holds the same number of experts); choose a size that divides it");
}

Tensor ExpertExchange::dispatch(const Tensor& slots, const std::vector<int64_t>& offsets) {
  const ExchangeSpan span(group_.events(), "expert dispatch");
  const int ranks = group_.size();
  const int64_t width = slots.size(1), local = local_experts_;
  TESSERA_CHECK(int64_t(offsets.size()) == num_experts_ + 1 && offsets.back() == slots.size(0),
                "ExpertExchange::dispatch: offsets for ", offsets.size() - 1, " experts ending at ", offsets.back(),
                ", expected ", num_experts_, " ending at the ", slots.size(0), " slots");
  // Rows per (destination, its local expert), and what every source sends here.
  std::vector<int64_t> per_expert(static_cast<size_t>(num_experts_));
  for (int64_t e = 0; e < num_experts_; ++e) per_expert[size_t(e)] = offsets[size_t(e + 1)] - offsets[size_t(e)];
  Context& ctx = slots.context();
  Tensor mine = ctx.from_vector(Shape{num_experts_}, per_expert, slots.device());
  Tensor theirs = ctx.empty(Shape{num_experts_}, DType::i64, slots.device());
  const std::vector<int64_t> per_rank(size_t(ranks), local);
  group_.all_to_all(mine, per_rank, theirs, per_rank)->wait();
  const std::vector<int64_t> arriving = theirs.to_vector<int64_t>();  // [source][local expert]
  sent_rows_.assign(size_t(ranks), 0);
  received_rows_.assign(size_t(ranks), 0);
  for (int q = 0; q < ranks; ++q)
    for (int64_t l = 0; l < local; ++l) {
      sent_rows_[size_t(q)] += per_expert[size_t(q * local + l)];
      received_rows_[size_t(q)] += arriving[size_t(q * local + l)];
    }
  int64_t total = 0;
  for (const int64_t r : received_rows_) total += r;
  Tensor received = ctx.empty(Shape{total, width}, slots.dtype(), slots.device());
  group_.all_to_all(slots, elements(sent_rows_, width), received, elements(received_rows_, width))->wait();
  // Regroup source-major [source][local expert] into expert-major [local expert][source].
  std::vector<int64_t> source_start(size_t(ranks) + 1, 0);
  for (int q = 0; q < ranks; ++q) source_start[size_t(q) + 1] = source_start[size_t(q)] + received_rows_[size_t(q)];
  std::vector<int32_t> order, inverse(static_cast<size_t>(total));
  local_offsets_.assign(1, 0);
  for (int64_t l = 0; l < local; ++l) {
    for (int q = 0; q < ranks; ++q) {
      int64_t at = source_start[size_t(q)];
      for (int64_t before = 0; before < l; ++before) at += arriving[size_t(q * local + before)];
      for (int64_t i = 0; i < arriving[size_t(q * local + l)]; ++i) {
        inverse[size_t(at + i)] = int32_t(order.size());
        order.push_back(int32_t(at + i));
      }
    }
    local_offsets_.push_back(int64_t(order.size()));
  }
  to_expert_order_ = ctx.from_vector(Shape{total}, order, slots.device());
  to_source_order_ = ctx.from_vector(Shape{total}, inverse, slots.device());
  Tensor rows = gather_rows(received, to_expert_order_);
  span.end();
  return rows;
}

Tensor ExpertExchange::combine(const Tensor& rows) {
  TESSERA_CHECK(to_source_order_.defined() && rows.size(0) == to_source_order_.size(0),
                "ExpertExchange::combine: ", rows.size(0), " rows, but the last dispatch delivered ",
                to_source_order_.defined() ? to_source_order_.size(0) : 0);
  const ExchangeSpan span(group_.events(), "expert combine");
  const int64_t width = rows.size(1);
  const Tensor by_source = gather_rows(rows, to_source_order_);
  int64_t total = 0;
  for (const int64_t r : sent_rows_) total += r;
  Tensor back = rows.context().empty(Shape{total, width}, rows.dtype(), rows.device());
  group_.all_to_all(by_source, elements(received_rows_, width), back, elements(sent_rows_, width))->wait();
  span.end();
  return back;
}

}  // namespace tessera::parallel
