// The training loop: set-up from TrainConfig, the step (micro-batches,
// accumulation, clipping, loss scaling, non-finite handling), evaluation,
// and progress/metrics/trace reporting.
#include "apps/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "core/context.h"
#include "core/nn/grad_scaler.h"
#include "core/nn/loss.h"
#include "core/nn/lr_schedule.h"
#include "core/nn/models.h"
#include "core/nn/optimizer.h"
#include "io/dataset.h"
#include "io/loader.h"
#include "io/metrics.h"
#include "io/progress.h"
#include "io/trace.h"
#include "kernels/ops.h"

namespace tessera::app {
namespace {

using Clock = std::chrono::steady_clock;

DType compute_dtype(const std::string& precision) {
  if (precision == "bf16") return DType::bf16;
  if (precision == "fp16") return DType::f16;
  return DType::f32;
}

// The model's configuration from the flags and, when there is data, from the
// dataset (input shape and classes, or vocabulary).
nn::ModelConfig model_config(const TrainConfig& c, const std::optional<io::DatasetInfo>& data) {
  nn::ModelConfig m;
  m.kind = c.model;
  m.hidden = c.hidden;
  m.vocab_size = c.vocab_size;
  m.seq_length = c.seq_length;
  m.num_layers = c.num_layers;
  m.num_heads = c.num_heads;
  m.hidden_size = c.hidden_size;
  m.ffn_hidden_size = c.ffn_hidden_size;
  m.dropout = c.hidden_dropout;
  m.recompute = c.recompute;
  if (!data) return m;
  const bool wants_tokens = c.model == "gpt";
  const bool has_tokens = data->kind == io::DatasetKind::tokens;
  TESSERA_CHECK(wants_tokens == has_tokens, "--model ", c.model, " needs ",
                wants_tokens ? "a token dataset (tessera prepare text)" : "an image dataset (tessera prepare idx)",
                " but ", data->path, " holds ", has_tokens ? "tokens" : "images");
  if (has_tokens) {
    TESSERA_CHECK(c.vocab_size >= data->vocab_size, "--vocab-size ", c.vocab_size, " is smaller than the vocabulary (",
                  data->vocab_size, ") of ", data->path, "; raise --vocab-size to at least ", data->vocab_size);
  } else {
    m.channels = data->channels;
    m.height = data->height;
    m.width = data->width;
    m.num_classes = data->num_classes;
  }
  return m;
}

// Where batches come from: a prepared file through the background loader, or
// one fixed random batch of the model's shapes (--synthetic).
class BatchSource {
 public:
  BatchSource(Context& ctx, const TrainConfig& c, const nn::ModelConfig& m, Device device, DType dtype) {
    if (!c.synthetic) {
      io::LoaderOptions options;
      options.batch_size = c.micro_batch_size;
      options.seed = c.seed;
      options.device = device;
      options.input_dtype = dtype;
      options.seq_length = c.seq_length;
      loader_ = std::make_unique<io::DataLoader>(ctx, c.data, options);
      return;
    }
    std::mt19937_64 rng(c.seed);
    const int64_t b = c.micro_batch_size;
    if (m.kind == "gpt") {
      std::uniform_int_distribution<int32_t> token(0, int32_t(m.vocab_size - 1));
      std::vector<int32_t> ids(size_t(b * c.seq_length)), next(ids.size());
      for (auto& v : ids) v = token(rng);
      for (auto& v : next) v = token(rng);
      synthetic_.inputs = ctx.from_vector(Shape{b, c.seq_length}, ids, device);
      synthetic_.targets = ctx.from_vector(Shape{b, c.seq_length}, next, device);
    } else {
      synthetic_.inputs = ctx.empty(Shape{b, m.channels, m.height, m.width}, dtype, device);
      synthetic_.inputs.uniform_at_(c.seed, 7, 0, 0.0f, 1.0f);
      std::uniform_int_distribution<int32_t> label(0, int32_t(m.num_classes - 1));
      std::vector<int32_t> labels(static_cast<size_t>(b));
      for (auto& v : labels) v = label(rng);
      synthetic_.targets = ctx.from_vector(Shape{b}, labels, device);
    }
  }

  io::Batch next() { return loader_ ? loader_->next() : synthetic_; }
  // Batches per epoch; 0 for synthetic data (no epochs).
  int64_t batches_per_epoch() const { return loader_ ? loader_->batches_per_epoch() : 0; }

 private:
  std::unique_ptr<io::DataLoader> loader_;
  io::Batch synthetic_;
};

// The name of the first parameter whose gradient holds an inf or NaN (for the
// message when the run has to stop).
std::string first_non_finite_gradient(const std::vector<nn::Parameter*>& parameters) {
  for (nn::Parameter* p : parameters) {
    Tensor out = p->grad.context().empty(Shape{1}, DType::f32, p->grad.device());
    ops::sum_squares(p->grad, out);
    if (!std::isfinite(out.to_vector<float>()[0])) return p->name;
  }
  return "(none: the norm itself overflowed)";
}

EvalResult evaluate(Context& ctx, nn::Module& model, const TrainConfig& c, Device device, DType dtype,
                    io::TraceWriter& trace) {
  auto scope = trace.scope("eval", "eval");
  io::LoaderOptions options;
  options.batch_size = c.micro_batch_size;
  options.seed = c.seed;
  options.shuffle = false;
  options.drop_last = false;
  options.device = device;
  options.input_dtype = dtype;
  options.seq_length = c.seq_length;
  io::DataLoader loader(ctx, c.eval_data, options);
  const int64_t batches =
      c.eval_iters > 0 ? std::min(c.eval_iters, loader.batches_per_epoch()) : loader.batches_per_epoch();
  const bool classifier = c.model != "gpt";
  const nn::CrossEntropyLoss loss;
  double loss_sum = 0.0;
  int64_t count = 0, correct = 0;
  model.eval();
  for (int64_t i = 0; i < batches; ++i) {
    io::Batch batch = loader.next();
    if (batch.targets.numel() == 0) continue;
    nn::Saved saved, loss_saved;
    Tensor logits = model.forward(batch.inputs, saved, nn::Pass{c.seed, 0, 0});
    if (classifier) correct += nn::count_correct(logits, batch.targets);
    const nn::LossValue value = loss.forward(logits, batch.targets, loss_saved);
    loss_sum += value.loss * double(value.count);
    count += value.count;
  }
  model.train();
  EvalResult result;
  result.count = count;
  result.loss = count > 0 ? loss_sum / double(count) : 0.0;
  if (classifier) result.accuracy = count > 0 ? double(correct) / double(count) : 0.0;
  return result;
}

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::nth_element(values.begin(), values.begin() + long(values.size() / 2), values.end());
  return values[values.size() / 2];
}

}  // namespace

TrainResult train(const TrainConfig& c) {
  validate(c);
  ContextOptions context_options;
  context_options.cpu_threads = c.threads;
  Context ctx(context_options);
  const Device device = parse_device(c.device);
  const DType dtype = compute_dtype(c.precision);

  std::optional<io::DatasetInfo> data_info;
  if (!c.synthetic) data_info = io::inspect_dataset(c.data);
  if (!c.eval_data.empty()) {
    const io::DatasetInfo eval_info = io::inspect_dataset(c.eval_data);
    TESSERA_CHECK(!data_info || eval_info.kind == data_info->kind, "--eval-data ", c.eval_data,
                  " holds another kind of data than --data ", c.data);
  }
  const nn::ModelConfig model_cfg = model_config(c, data_info);
  nn::ModelSpec spec;
  spec.context = &ctx;
  spec.device = device;
  spec.dtype = dtype;
  spec.seed = c.seed;
  std::unique_ptr<nn::Module> model = nn::build_model(model_cfg, spec);
  std::vector<nn::Parameter*> parameters = model->parameters();

  nn::OptimizerConfig opt;
  opt.kind = nn::parse_optimizer_kind(c.optimizer);
  opt.lr = c.lr;
  opt.weight_decay = c.weight_decay;
  opt.beta1 = c.adam_beta1;
  opt.beta2 = c.adam_beta2;
  opt.eps = c.adam_eps;
  if (opt.kind == nn::OptimizerKind::sgd) {
    opt.momentum = c.sgd_momentum;
    opt.nesterov = c.nesterov;
  }
  nn::Optimizer optimizer(parameters, opt);

  BatchSource source(ctx, c, model_cfg, device, dtype);
  const int64_t accumulation = c.global_batch_size > 0 ? c.global_batch_size / c.micro_batch_size : 1;
  int64_t total_steps = c.train_steps;
  if (c.epochs > 0) {
    const double micro_batches = c.epochs * double(source.batches_per_epoch());
    total_steps = std::max<int64_t>(1, int64_t(micro_batches / double(accumulation)));
  }
  nn::LrScheduleConfig schedule_cfg;
  schedule_cfg.style = nn::parse_lr_style(c.lr_decay_style);
  schedule_cfg.lr = c.lr;
  schedule_cfg.min_lr = c.min_lr;
  schedule_cfg.warmup_steps = c.warmup_steps;
  schedule_cfg.total_steps = total_steps;
  const nn::LrSchedule schedule(schedule_cfg);
  nn::GradScaler scaler = nn::GradScaler::for_dtype(dtype);
  const nn::CrossEntropyLoss loss;

  io::ProgressOptions progress_options;
  progress_options.interval = c.log_interval;
  io::ProgressLine progress(progress_options);
  bool katib_due = true;
  io::MetricsOptions metrics_options;
  metrics_options.path = c.metrics;
  metrics_options.katib = [&](std::string_view line) {
    if (katib_due) progress.print_above(line);
  };
  io::MetricsWriter metrics(metrics_options);
  io::TraceOptions trace_options;
  trace_options.path = c.trace;
  io::TraceWriter trace(trace_options);

  std::printf("tessera train: %s\n%s\n", ctx.describe().c_str(), describe(c).c_str());
  if (data_info) std::printf("data: %s\n", data_info->describe().c_str());
  std::printf("model: %s, %lld parameters, %s on %s; %lld steps of %lld micro-batch(es) of %lld\n", c.model.c_str(),
              static_cast<long long>(nn::parameter_count(*model)), std::string(dtype_name(dtype)).c_str(),
              device.to_string().c_str(), static_cast<long long>(total_steps),
              static_cast<long long>(accumulation), static_cast<long long>(c.micro_batch_size));
  std::fflush(stdout);
  metrics.log_run({{"model", c.model}, {"precision", c.precision}, {"device", device.to_string()}});

  const bool tokens = c.model == "gpt";
  const int64_t samples_per_step = accumulation * c.micro_batch_size;
  const bool evaluate_per_epoch = c.eval_interval == 0 && source.batches_per_epoch() > 0;
  const int64_t steps_per_epoch = evaluate_per_epoch ? std::max<int64_t>(1, source.batches_per_epoch() / accumulation) : 0;

  TrainResult result;
  std::vector<double> step_ms;
  int64_t consecutive_skips = 0;
  for (int64_t step = 0; step < total_steps; ++step) {
    const auto start = Clock::now();
    nn::zero_grads(parameters);
    const float loss_scale = scaler.scale();
    double loss_sum = 0.0;
    int64_t epoch = 0;
    for (int64_t micro = 0; micro < accumulation; ++micro) {
      io::Batch batch;
      {
        auto scope = trace.scope("data_wait", "data");
        batch = source.next();
      }
      epoch = batch.epoch;
      nn::Saved saved, loss_saved;
      Tensor logits;
      {
        auto scope = trace.scope("forward", "compute");
        logits = model->forward(batch.inputs, saved, nn::Pass{c.seed, uint64_t(step), uint64_t(micro)});
        loss_sum += loss.forward(logits, batch.targets, loss_saved).loss;
      }
      {
        auto scope = trace.scope("backward", "compute");
        loss.backward(logits, batch.targets, loss_scale / float(accumulation), loss_saved);
        model->backward(logits, saved);
      }
    }
    bool skipped = false;
    nn::GradNorm norm;
    const double lr = schedule.lr(step);
    {
      auto scope = trace.scope("optimizer", "compute");
      norm = nn::global_grad_norm(parameters);
      skipped = scaler.update(!norm.finite) || !norm.finite;
      if (!skipped) optimizer.step(float(lr), nn::clip_coefficient(norm.norm / loss_scale, c.clip_grad) / loss_scale);
    }
    if (skipped && !scaler.enabled()) {
      ++result.skipped_steps;
      TESSERA_CHECK(++consecutive_skips < c.max_skipped_steps, "step ", step + 1, ": non-finite gradients in ",
                    consecutive_skips, " consecutive steps (first non-finite gradient: ",
                    first_non_finite_gradient(parameters),
                    "); lower --lr, enable --clip-grad, or check the data; the run stops here");
    } else if (skipped) {
      ++result.skipped_steps;
    } else {
      consecutive_skips = 0;
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    step_ms.push_back(seconds * 1e3);

    io::StepRecord record;
    record.step = step + 1;
    record.total_steps = total_steps;
    record.loss = loss_sum / double(accumulation);
    record.lr = lr;
    record.ms_per_step = seconds * 1e3;
    if (tokens)
      record.tokens_per_s = double(samples_per_step * c.seq_length) / seconds;
    else
      record.samples_per_s = double(samples_per_step) / seconds;
    record.grad_norm = norm.norm / loss_scale;
    if (scaler.enabled()) record.loss_scale = loss_scale;
    record.skipped = skipped;
    record.epoch = epoch;
    katib_due = (step + 1) % c.log_interval == 0 || step + 1 == total_steps;
    metrics.log_step(record);
    progress.update(record);
    result.last_loss = record.loss;
    result.steps = step + 1;

    const bool last = step + 1 == total_steps;
    const bool due = c.eval_interval > 0 ? (step + 1) % c.eval_interval == 0
                                         : evaluate_per_epoch && (step + 1) % steps_per_epoch == 0;
    if (!c.eval_data.empty() && (due || last)) {
      const EvalResult eval = evaluate(ctx, *model, c, device, dtype, trace);
      io::EvalRecord eval_record;
      eval_record.step = step + 1;
      eval_record.eval_loss = eval.loss;
      eval_record.eval_accuracy = eval.accuracy;
      if (tokens) eval_record.eval_bits_per_byte = eval.loss / std::log(2.0);
      katib_due = true;
      metrics.log_eval(eval_record);
      char line[160];
      if (eval.accuracy)
        std::snprintf(line, sizeof line, "eval step %lld: loss %.4f, accuracy %.2f%% (%lld samples)",
                      static_cast<long long>(step + 1), eval.loss, 100.0 * *eval.accuracy,
                      static_cast<long long>(eval.count));
      else
        std::snprintf(line, sizeof line, "eval step %lld: loss %.4f nats/token (%.3f bits) over %lld tokens",
                      static_cast<long long>(step + 1), eval.loss, eval.loss / std::log(2.0),
                      static_cast<long long>(eval.count));
      progress.print_above(line);
      if (last) result.final_eval = eval;
    }
  }
  progress.finish();
  trace.close();
  result.median_ms_per_step = median(step_ms);
  std::printf("done: %lld steps, last loss %.4f, median %.1f ms/step", static_cast<long long>(result.steps),
              result.last_loss, result.median_ms_per_step);
  if (result.skipped_steps) std::printf(", %lld skipped", static_cast<long long>(result.skipped_steps));
  std::printf("\n");
  if (!c.metrics.empty()) std::printf("metrics: %s (plot with: tessera plot %s -o curves.svg)\n", c.metrics.c_str(),
                                      c.metrics.c_str());
  if (!c.trace.empty()) std::printf("trace: %s (open in https://ui.perfetto.dev)\n", c.trace.c_str());
  std::fflush(stdout);
  return result;
}

}  // namespace tessera::app
