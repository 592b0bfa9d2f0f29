// TrainConfig: flags, the TOML file, validation and the start-up echo.
#include "apps/train_config.h"

#include <charconv>
#include <filesystem>
#include <sstream>

#include "core/error.h"

namespace tessera::app {

void add_train_options(CLI::App& command, TrainConfig& c) {
  // A flag given twice keeps its last value, as with argparse (Megatron,
  // torchrun): launch scripts append overrides to a list of defaults.
  command.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  command.add_option("--config", c.config_file, "TOML file of settings (keys are flag names); flags override it")
      ->check(CLI::ExistingFile);

  const std::string model = "Model";
  command.add_option("--model", c.model, "Model: mlp, cnn or gpt")
      ->check(CLI::IsMember({"mlp", "cnn", "gpt"}))
      ->group(model);
  command.add_option("--hidden", c.hidden, "MLP hidden sizes, e.g. 1024,1024")
      ->delimiter(',')
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->group(model);
  command.add_option("--vocab-size", c.vocab_size, "GPT vocabulary size")->group(model);
  command.add_option("--seq-length", c.seq_length, "GPT context length")->group(model);
  command.add_option("--num-layers", c.num_layers, "GPT Transformer blocks")->group(model);
  command.add_option("--num-heads", c.num_heads, "GPT attention heads")->group(model);
  command.add_option("--hidden-size", c.hidden_size, "GPT model width")->group(model);
  command.add_option("--ffn-hidden-size", c.ffn_hidden_size, "GPT MLP width (0: 4 x hidden size)")->group(model);
  command.add_option("--hidden-dropout", c.hidden_dropout, "Dropout after attention and MLP (GPT)")->group(model);
  command.add_flag("--recompute", c.recompute, "Recompute each Transformer block's activations in backward")
      ->group(model);

  const std::string data = "Data";
  command.add_option("--data", c.data, "Training data: an HDF5 file made by `tessera prepare`")->group(data);
  command.add_option("--eval-data", c.eval_data, "Held-out data for evaluation (same format)")->group(data);
  command.add_flag("--synthetic", c.synthetic, "Random data of the model's shapes (smoke runs, benchmarks)")
      ->group(data);

  const std::string schedule = "Batches and schedule";
  command.add_option("--micro-batch-size", c.micro_batch_size, "Samples per forward/backward pass")->group(schedule);
  command
      .add_option("--global-batch-size", c.global_batch_size,
                  "Samples per optimizer step (a multiple of the micro-batch size; 0: one micro-batch)")
      ->group(schedule);
  command.add_option("--train-steps", c.train_steps, "Optimizer steps to run")->group(schedule);
  command.add_option("--epochs", c.epochs, "Passes over the training data (instead of --train-steps)")->group(schedule);
  command.add_option("--optimizer", c.optimizer, "adamw or sgd")
      ->check(CLI::IsMember({"adamw", "sgd"}))
      ->group(schedule);
  command.add_option("--lr", c.lr, "Peak learning rate")->group(schedule);
  command.add_option("--min-lr", c.min_lr, "Learning rate at the end of the decay")->group(schedule);
  command.add_option("--warmup-steps", c.warmup_steps, "Steps of linear warm-up from 0 to --lr")->group(schedule);
  command.add_option("--lr-decay-style", c.lr_decay_style, "cosine or constant")
      ->check(CLI::IsMember({"cosine", "constant"}))
      ->group(schedule);
  command.add_option("--weight-decay", c.weight_decay, "Decoupled (AdamW) or L2 (SGD) weight decay")->group(schedule);
  command.add_option("--adam-beta1", c.adam_beta1)->group(schedule);
  command.add_option("--adam-beta2", c.adam_beta2)->group(schedule);
  command.add_option("--adam-eps", c.adam_eps)->group(schedule);
  command.add_option("--sgd-momentum", c.sgd_momentum)->group(schedule);
  command.add_flag("--nesterov", c.nesterov, "Nesterov momentum (SGD)")->group(schedule);
  command.add_option("--clip-grad", c.clip_grad, "Clip the global gradient norm to this (0: off)")->group(schedule);
  command
      .add_option("--max-skipped-steps", c.max_skipped_steps,
                  "Consecutive steps with non-finite gradients before the run stops")
      ->group(schedule);

  const std::string machine = "Precision and machine";
  command.add_option("--precision", c.precision, "fp32, bf16 (f32 master weights) or fp16 (with loss scaling)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->group(machine);
  command
      .add_option("--device", c.device,
                  "cpu, cuda (each rank its node-local GPU) or cuda:N; emu: an emulated accelerator per rank, "
                  "for rehearsing GPU paths on the CPU")
      ->group(machine);
  command.add_option("--threads", c.threads, "CPU threads (0: OpenMP's default)")->group(machine);
  command.add_option("--seed", c.seed, "Seed of initialisation, data order and dropout")->group(machine);

  const std::string parallel = "Parallelism (launch with mpirun -np N; dp = N / (tensor-parallel x pipeline-parallel))";
  command
      .add_option("--tensor-parallel,--tp", c.tensor_parallel,
                  "Split every GPT layer over K ranks (column/row-parallel, vocab-parallel embedding and loss)")
      ->check(CLI::PositiveNumber)
      ->group(parallel);
  command
      .add_option("--pipeline-parallel,--pp", c.pipeline_parallel,
                  "Split the model's layers into P pipeline stages (gpt, mlp); micro-batches = global batch / "
                  "(micro-batch x dp)")
      ->check(CLI::PositiveNumber)
      ->group(parallel);
  command.add_option("--pipeline-schedule", c.pipeline_schedule, "gpipe or 1f1b (at most P micro-batches in flight)")
      ->check(CLI::IsMember({"gpipe", "1f1b"}))
      ->group(parallel);
  command
      .add_option("--pipeline-split", c.pipeline_split,
                  "Stage boundaries in layers, e.g. 0,5,9,12 for 3 stages of a 12-layer GPT (default: balanced by "
                  "parameter count)")
      ->group(parallel);
  command
      .add_flag("--sequence-parallel", c.sequence_parallel,
                "With --tensor-parallel K > 1: shard LayerNorm and dropout activations along the sequence")
      ->group(parallel);
  command.add_option("--zero", c.zero, "0: plain data parallelism; 1: optimizer state sharded over ranks (ZeRO-1)")
      ->check(CLI::IsMember({0, 1}))
      ->group(parallel);
  command
      .add_option("--bucket-size-mb", c.bucket_size_mb,
                  "MiB of f32 gradients per all-reduce bucket (each starts as soon as backward fills it)")
      ->group(parallel);
  command
      .add_option("--comm-timeout", c.comm_timeout,
                  "Seconds a collective or transfer may take before the job stops, naming the stalled ranks "
                  "(0: no limit)")
      ->check(CLI::NonNegativeNumber)
      ->group(parallel);
  command
      .add_option("--comm-backend", c.comm_backend,
                  "auto (NCCL for device tensors when built, MPI for host tensors), mpi, or nccl (as auto, but NCCL is "
                  "required)")
      ->check(CLI::IsMember({"auto", "mpi", "nccl"}))
      ->group(parallel);

  const std::string output = "Evaluation and output";
  command.add_option("--eval-interval", c.eval_interval, "Steps between evaluations (0: every epoch and at the end)")
      ->group(output);
  command.add_option("--eval-iters", c.eval_iters, "Batches per evaluation (0: the whole eval set)")->group(output);
  command.add_option("--log-interval", c.log_interval, "Steps between progress lines when not on a terminal")
      ->group(output);
  command.add_option("--metrics", c.metrics, "Write metrics as JSON lines to this file")->group(output);
  command.add_option("--trace", c.trace, "Write a Chrome-trace (Perfetto) timeline to this file")->group(output);

  const std::string checkpoints = "Checkpoints and resuming";
  command
      .add_option("--save", c.save,
                  "Write checkpoints to DIR/step_XXXXXXXX/ (at the end, every --save-interval "
                  "steps, and on SIGTERM/SIGUSR1)")
      ->group(checkpoints);
  command
      .add_option("--save-interval", c.save_interval, "Steps between checkpoints (0: only at the end and on a signal)")
      ->group(checkpoints);
  command.add_option("--keep-checkpoints", c.keep_checkpoints, "Keep only the newest K checkpoints (0: keep all)")
      ->group(checkpoints);
  command
      .add_option("--resume", c.resume,
                  "auto (the newest complete checkpoint in --save DIR, or a fresh start if there is none), or the "
                  "path of a checkpoint (DIR/step_XXXXXXXX) or of a --save directory")
      ->group(checkpoints);
  command
      .add_option("--exit-interval", c.exit_interval,
                  "Stop (after saving, with --save) once the step is a multiple of N; --resume goes on from there")
      ->group(checkpoints);
}

void apply_config_file(CLI::App& command, TrainConfig& config) {
  if (config.config_file.empty()) return;
  std::vector<CLI::ConfigItem> items;
  try {
    items = CLI::ConfigTOML().from_file(config.config_file);
  } catch (const CLI::Error& error) {
    TESSERA_THROW("--config ", config.config_file, ": cannot read it as TOML: ", error.what());
  }
  for (const CLI::ConfigItem& item : items) {
    if (item.name == "++" || item.name == "--") continue;  // CLI11's section markers
    std::string name = item.name;
    for (char& ch : name)
      if (ch == '_') ch = '-';
    CLI::Option* option = command.get_option_no_throw("--" + name);
    TESSERA_CHECK(option != nullptr && name != "config", "--config ", config.config_file, ": unknown setting '",
                  item.fullname(), "'; keys are the flags of `tessera train --help` without the dashes");
    if (option->count() > 0) continue;  // given on the command line: the flag wins
    try {
      option->add_result(item.inputs);
      option->run_callback();
    } catch (const CLI::Error& error) {
      TESSERA_THROW("--config ", config.config_file, ": bad value for '", item.name, "': ", error.what());
    }
  }
}

void validate(const TrainConfig& c) {
  TESSERA_CHECK(c.synthetic || !c.data.empty(),
                "no training data: give --data FILE (made by `tessera prepare`) or --synthetic");
  TESSERA_CHECK(!(c.synthetic && !c.data.empty()), "--synthetic and --data exclude each other; pick one");
  for (const std::string* path : {&c.data, &c.eval_data})
    TESSERA_CHECK(path->empty() || std::filesystem::exists(*path), "data file ", *path,
                  " does not exist; make it with `tessera prepare idx|text ... -o ", *path, "`");
  TESSERA_CHECK(c.micro_batch_size > 0, "--micro-batch-size must be positive, got ", c.micro_batch_size);
  TESSERA_CHECK(c.global_batch_size >= 0 && c.global_batch_size % c.micro_batch_size == 0, "--global-batch-size ",
                c.global_batch_size, " is not a multiple of --micro-batch-size ", c.micro_batch_size);
  TESSERA_CHECK((c.train_steps > 0) != (c.epochs > 0),
                "give exactly one of --train-steps N and --epochs E (both positive); got --train-steps ", c.train_steps,
                " and --epochs ", c.epochs);
  TESSERA_CHECK(!(c.synthetic && c.epochs > 0), "--synthetic data has no epochs: use --train-steps");
  TESSERA_CHECK(c.lr > 0, "--lr must be positive, got ", c.lr);
  TESSERA_CHECK(c.min_lr >= 0 && c.min_lr <= c.lr, "--min-lr ", c.min_lr, " must be in [0, --lr ", c.lr, "]");
  TESSERA_CHECK(c.warmup_steps >= 0, "--warmup-steps must not be negative, got ", c.warmup_steps);
  TESSERA_CHECK(c.weight_decay >= 0, "--weight-decay must not be negative, got ", c.weight_decay);
  TESSERA_CHECK(c.clip_grad >= 0, "--clip-grad must not be negative (0 turns clipping off), got ", c.clip_grad);
  TESSERA_CHECK(c.threads >= 0, "--threads must not be negative, got ", c.threads);
  TESSERA_CHECK(c.eval_interval >= 0 && c.eval_iters >= 0 && c.log_interval > 0,
                "--eval-interval and --eval-iters must not be negative and --log-interval must be positive");
  TESSERA_CHECK(c.max_skipped_steps > 0, "--max-skipped-steps must be positive, got ", c.max_skipped_steps);
  TESSERA_CHECK(c.zero == 0 || c.zero == 1, "--zero must be 0 or 1, got ", c.zero);
  TESSERA_CHECK(c.tensor_parallel >= 1, "--tensor-parallel must be at least 1, got ", c.tensor_parallel);
  TESSERA_CHECK(c.pipeline_parallel >= 1, "--pipeline-parallel must be at least 1, got ", c.pipeline_parallel);
  TESSERA_CHECK(c.pipeline_parallel == 1 || c.model == "gpt" || c.model == "mlp", "--pipeline-parallel ",
                c.pipeline_parallel, " splits the layers of --model gpt or mlp; --model ", c.model,
                " trains with --pipeline-parallel 1");
  TESSERA_CHECK(c.pipeline_schedule == "gpipe" || c.pipeline_schedule == "1f1b", "--pipeline-schedule '",
                c.pipeline_schedule, "' is not a schedule this build knows; use gpipe or 1f1b");
  TESSERA_CHECK(c.pipeline_split.empty() || c.pipeline_parallel > 1, "--pipeline-split '", c.pipeline_split,
                "' needs --pipeline-parallel > 1");
  TESSERA_CHECK(c.tensor_parallel == 1 || c.model == "gpt", "--tensor-parallel ", c.tensor_parallel,
                " splits the layers of --model gpt; --model ", c.model,
                " trains with data parallelism only (drop --tensor-parallel)");
  TESSERA_CHECK(c.bucket_size_mb > 0, "--bucket-size-mb must be positive, got ", c.bucket_size_mb);
  TESSERA_CHECK(c.comm_backend == "auto" || c.comm_backend == "mpi" || c.comm_backend == "nccl",
                "--comm-backend must be auto, mpi or nccl, got '", c.comm_backend, "'");
  TESSERA_CHECK(c.hidden_dropout >= 0 && c.hidden_dropout < 1, "--hidden-dropout must be in [0, 1), got ",
                c.hidden_dropout);
  TESSERA_CHECK(c.save_interval >= 0, "--save-interval must not be negative (0: save only at the end and on a ",
                "signal), got ", c.save_interval);
  TESSERA_CHECK(c.keep_checkpoints >= 0, "--keep-checkpoints must not be negative (0: keep all), got ",
                c.keep_checkpoints);
  TESSERA_CHECK(c.exit_interval >= 0, "--exit-interval must not be negative (0: off), got ", c.exit_interval);
  TESSERA_CHECK(!c.save.empty() || (c.save_interval == 0 && c.keep_checkpoints == 0),
                "--save-interval and --keep-checkpoints need --save DIR (where checkpoints go)");
  TESSERA_CHECK(c.resume != "auto" || !c.save.empty(),
                "--resume auto looks for the newest checkpoint in the --save directory; give --save DIR too (or "
                "--resume PATH to a checkpoint)");
  TESSERA_CHECK(c.resume.empty() || c.resume == "auto" || std::filesystem::exists(c.resume), "--resume ", c.resume,
                ": no such checkpoint; give a checkpoint directory (DIR/step_XXXXXXXX), a --save directory, or "
                "--resume auto");
}

std::string describe(const TrainConfig& c) {
  std::ostringstream out;
  auto list = [](const std::vector<int64_t>& values) {
    std::string text;
    for (size_t i = 0; i < values.size(); ++i) text += (i ? "," : "") + std::to_string(values[i]);
    return text;
  };
  out << "model=" << c.model;
  if (c.model == "mlp") out << " hidden=" << list(c.hidden);
  if (c.model == "gpt")
    out << " vocab_size=" << c.vocab_size << " seq_length=" << c.seq_length << " num_layers=" << c.num_layers
        << " num_heads=" << c.num_heads << " hidden_size=" << c.hidden_size << " ffn_hidden_size=" << c.ffn_hidden_size
        << " hidden_dropout=" << c.hidden_dropout << " recompute=" << c.recompute;
  out << "\ndata=" << (c.synthetic ? "synthetic" : c.data) << " eval_data=" << c.eval_data
      << "\nmicro_batch_size=" << c.micro_batch_size << " global_batch_size=" << c.global_batch_size
      << " train_steps=" << c.train_steps << " epochs=" << c.epochs << "\noptimizer=" << c.optimizer << " lr=" << c.lr
      << " min_lr=" << c.min_lr << " warmup_steps=" << c.warmup_steps << " lr_decay_style=" << c.lr_decay_style
      << " weight_decay=" << c.weight_decay << " clip_grad=" << c.clip_grad << "\nprecision=" << c.precision
      << " device=" << c.device << " threads=" << c.threads << " seed=" << c.seed
      << "\ntensor_parallel=" << c.tensor_parallel << " sequence_parallel=" << c.sequence_parallel
      << " pipeline_parallel=" << c.pipeline_parallel << " pipeline_schedule=" << c.pipeline_schedule
      << " pipeline_split=" << c.pipeline_split << " zero=" << c.zero << " bucket_size_mb=" << c.bucket_size_mb
      << " comm_backend=" << c.comm_backend << " comm_timeout=" << c.comm_timeout
      << "\neval_interval=" << c.eval_interval << " eval_iters=" << c.eval_iters << " metrics=" << c.metrics
      << " trace=" << c.trace;
  if (!c.save.empty() || !c.resume.empty())
    out << "\nsave=" << c.save << " save_interval=" << c.save_interval << " keep_checkpoints=" << c.keep_checkpoints
        << " resume=" << c.resume << " exit_interval=" << c.exit_interval;
  return out.str();
}

namespace {

// The shortest text that reads back as the same float (std::to_chars).
std::string exact(float value) {
  char text[64];
  const auto result = std::to_chars(text, text + sizeof text, value);
  return std::string(text, result.ptr);
}

std::string exact(double value) {
  char text[64];
  const auto result = std::to_chars(text, text + sizeof text, value);
  return std::string(text, result.ptr);
}

}  // namespace

std::vector<std::pair<std::string, std::string>> settings(const TrainConfig& c) {
  std::string hidden;
  for (size_t i = 0; i < c.hidden.size(); ++i) hidden += (i ? "," : "") + std::to_string(c.hidden[i]);
  const auto flag = [](bool value) { return std::string(value ? "true" : "false"); };
  return {
      {"model", c.model},
      {"hidden", hidden},
      {"vocab-size", std::to_string(c.vocab_size)},
      {"seq-length", std::to_string(c.seq_length)},
      {"num-layers", std::to_string(c.num_layers)},
      {"num-heads", std::to_string(c.num_heads)},
      {"hidden-size", std::to_string(c.hidden_size)},
      {"ffn-hidden-size", std::to_string(c.ffn_hidden_size)},
      {"hidden-dropout", exact(c.hidden_dropout)},
      {"recompute", flag(c.recompute)},
      {"data", c.data},
      {"eval-data", c.eval_data},
      {"synthetic", flag(c.synthetic)},
      {"micro-batch-size", std::to_string(c.micro_batch_size)},
      {"global-batch-size", std::to_string(c.global_batch_size)},
      {"train-steps", std::to_string(c.train_steps)},
      {"epochs", exact(c.epochs)},
      {"optimizer", c.optimizer},
      {"lr", exact(c.lr)},
      {"min-lr", exact(c.min_lr)},
      {"warmup-steps", std::to_string(c.warmup_steps)},
      {"lr-decay-style", c.lr_decay_style},
      {"weight-decay", exact(c.weight_decay)},
      {"adam-beta1", exact(c.adam_beta1)},
      {"adam-beta2", exact(c.adam_beta2)},
      {"adam-eps", exact(c.adam_eps)},
      {"sgd-momentum", exact(c.sgd_momentum)},
      {"nesterov", flag(c.nesterov)},
      {"clip-grad", exact(c.clip_grad)},
      {"max-skipped-steps", std::to_string(c.max_skipped_steps)},
      {"precision", c.precision},
      {"device", c.device},
      {"threads", std::to_string(c.threads)},
      {"seed", std::to_string(c.seed)},
      {"tensor-parallel", std::to_string(c.tensor_parallel)},
      {"sequence-parallel", flag(c.sequence_parallel)},
      {"pipeline-parallel", std::to_string(c.pipeline_parallel)},
      {"pipeline-schedule", c.pipeline_schedule},
      {"pipeline-split", c.pipeline_split},
      {"zero", std::to_string(c.zero)},
      {"bucket-size-mb", exact(c.bucket_size_mb)},
      {"comm-backend", c.comm_backend},
      {"comm-timeout", exact(c.comm_timeout)},
      {"eval-interval", std::to_string(c.eval_interval)},
      {"eval-iters", std::to_string(c.eval_iters)},
      {"log-interval", std::to_string(c.log_interval)},
      {"metrics", c.metrics},
      {"trace", c.trace},
      {"config", c.config_file},
      {"save", c.save},
      {"save-interval", std::to_string(c.save_interval)},
      {"keep-checkpoints", std::to_string(c.keep_checkpoints)},
      {"resume", c.resume},
      {"exit-interval", std::to_string(c.exit_interval)},
  };
}

}  // namespace tessera::app
