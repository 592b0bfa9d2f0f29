// Evaluation during training (apps/train_evaluation.h): the pass sharded
// over the data-parallel ranks (through the pipeline's stages when there
// are several), its cadence, and its record for the other components.
#include "apps/train_evaluation.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "io/loader.h"
#include "nn/models.h"
#include "parallel/train_step.h"

namespace tessera::app {
namespace {

// The evaluation's record at `step`: loss, accuracy and, with
// `tokens_per_byte` (a language model's evaluation data, when its text's
// bytes are known), bits per byte = nats per token / ln 2 x tokens per byte.
io::EvalRecord eval_record(const EvalResult& eval, int64_t step, std::optional<double> tokens_per_byte) {
  io::EvalRecord record;
  record.step = step;
  record.eval_loss = eval.loss;
  record.eval_accuracy = eval.accuracy;
  if (tokens_per_byte) record.eval_bits_per_byte = eval.loss / std::log(2.0) * *tokens_per_byte;
  return record;
}

}  // namespace

// Each data-parallel rank evaluates its share of every global batch (the
// loader splits the last partial one evenly, so all ranks run the same
// number of batches), then the loss sums, target counts and correct counts
// are summed over the ranks. --eval-iters counts global batches. Under
// pipeline parallelism the batches flow through the stages and the last one
// computes the sums, which it then shares with the other stages. Under
// context parallelism each cp rank reads its share of the same sequences'
// tokens and the sums are summed over dp × cp: the loss is the mean over
// every target of the sequences, as one rank computes it.
EvalResult evaluate(const TrainConfig& c, const EvalModel& m, io::TraceWriter& trace) {
  auto scope = trace.scope("eval", "eval");
  parallel::Communicator& dp = m.data_parallel;
  io::LoaderOptions options;
  options.batch_size = c.micro_batch_size;
  options.seed = c.seed;
  options.shuffle = false;
  options.drop_last = false;
  options.device = m.device;
  options.input_dtype = m.dtype;
  options.seq_length = c.seq_length;
  options.shard_rank = dp.rank();
  options.shard_count = dp.size();
  options.token_positions = m.token_positions;
  io::DataLoader loader(m.context, c.eval_data, options);
  const int64_t batches =
      c.eval_iters > 0 ? std::min(c.eval_iters, loader.batches_per_epoch()) : loader.batches_per_epoch();
  const bool classifier = !nn::model_traits(c.model).reads_tokens;
  double loss_sum = 0.0;
  int64_t count = 0, correct = 0;
  m.model.eval();
  for (int64_t i = 0; i < batches; ++i) {
    io::Batch batch = loader.next();
    if (batch.targets.numel() == 0) continue;
    nn::Saved saved, loss_saved;
    const nn::Pass pass{c.seed, 0, 0};
    Tensor logits = m.engine ? m.engine->forward_only(batch.inputs, m.input_shape(batch.inputs), m.dtype, pass)
                             : m.model.forward(batch.inputs, saved, pass);
    if (!logits.defined()) continue;  // a pipeline stage before the last
    if (classifier) correct += nn::count_correct(logits, batch.targets);
    const nn::LossValue value = m.loss.forward(logits, batch.targets, loss_saved);
    loss_sum += value.loss * double(value.count);
    count += value.count;
  }
  m.model.train();
  // Summed over the replicas (dp, or dp × cp); under pipeline parallelism
  // computed by the last stage and handed to the others.
  const bool pipelined = m.engine && m.stages->size() > 1;
  if (m.replicas.size() > 1 || pipelined) {
    Tensor sum = m.context.from_vector(Shape{1}, std::vector<float>{float(loss_sum)}, m.device);
    Tensor counts = m.context.from_vector(Shape{2}, std::vector<int64_t>{count, correct}, m.device);
    parallel::share_last_stage_values({sum, counts}, *m.stages, m.replicas, parallel::ReduceOp::sum,
                                      m.engine ? m.engine->loss_stage() : -1);
    loss_sum = sum.to_vector<float>()[0];
    const std::vector<int64_t> totals = counts.to_vector<int64_t>();
    count = totals[0];
    correct = totals[1];
  }
  EvalResult result;
  result.count = count;
  result.loss = count > 0 ? loss_sum / double(count) : 0.0;
  if (classifier) result.accuracy = count > 0 ? double(correct) / double(count) : 0.0;
  return result;
}

std::optional<double> tokens_per_byte(const std::optional<io::DatasetInfo>& eval_data, bool tokens) {
  if (!tokens || !eval_data || !eval_data->text_bytes || *eval_data->text_bytes <= 0) return std::nullopt;
  return double(eval_data->num_tokens) / double(*eval_data->text_bytes);
}

EvaluationCadence::EvaluationCadence(const TrainConfig& c, EvalModel model, io::TraceWriter& trace,
                                     std::optional<double> tokens_per_byte, int64_t batches_per_epoch,
                                     int64_t micro_batches, io::TrainingEvents& events, TrainResult& result)
    : config_(c),
      model_(std::move(model)),
      trace_(trace),
      tokens_per_byte_(tokens_per_byte),
      events_(events),
      result_(result) {
  if (c.eval_interval == 0 && batches_per_epoch > 0)
    steps_per_epoch_ = std::max<int64_t>(1, batches_per_epoch / micro_batches);
}

bool EvaluationCadence::due(int64_t step, bool last) const {
  if (config_.eval_data.empty()) return false;
  if (last) return true;
  return config_.eval_interval > 0 ? step % config_.eval_interval == 0
                                   : steps_per_epoch_ > 0 && step % steps_per_epoch_ == 0;
}

void EvaluationCadence::on_step_end(io::StepEnd& end) {
  if (!due(end.step, end.last)) return;
  const EvalResult eval = evaluate(config_, model_, trace_);
  events_.evaluation(io::EvalEnd{eval_record(eval, end.step, tokens_per_byte_), eval.count, end.last});
  if (end.last) result_.final_eval = eval;
}

}  // namespace tessera::app
