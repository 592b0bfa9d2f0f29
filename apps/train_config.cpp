// TrainConfig: flags (with range messages in words), the reader of the TOML
// file, the refusal of settings a run would not use, suggestions for unknown
// flags and keys, validation and the start-up echo.
#include "apps/train_config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string_view>

#include "core/error.h"
#include "core/number_text.h"
#include "io/hf_llama.h"
#include "io/http_url.h"
#include "nn/model_kind.h"
#include "parallel/pipeline_schedule.h"

namespace tessera::app {
namespace {

// Validators whose messages say the allowed range in words: CLI11's
// PositiveNumber and NonNegativeNumber print it as "0.000000 to 1797693...
// (309 digits).000000" (the largest double).
CLI::Validator whole_number_at_least(int64_t least) {
  return CLI::Validator(
      [least](std::string& text) -> std::string {
        int64_t value = 0;
        if (CLI::detail::lexical_cast(text, value) && value >= least) return "";
        return "must be a whole number >= " + std::to_string(least) + ", got '" + text + "'";
      },
      least == 1 ? "POSITIVE" : ">= " + std::to_string(least));
}

// Seconds for a deadline, 0 meaning none. A year at most: the watchdogs turn
// the seconds into a clock duration in integer nanoseconds, which a value
// past 292 years would overflow (undefined behaviour, in practice a deadline
// in the past).
constexpr double kMaxTimeoutSeconds = 365.0 * 24 * 3600;

CLI::Validator timeout_seconds() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double value = 0;
        if (CLI::detail::lexical_cast(text, value) && value >= 0 && value <= kMaxTimeoutSeconds) return "";
        return "must be a number of seconds from 0 (no limit) to 31536000 (a year), got '" + text + "'";
      },
      "[0, 31536000]");
}

// Every numeric option: CLI11 turns an empty value (--seed "", seed = "")
// into 0 without a word, and takes nan and inf.
CLI::Validator a_finite_number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (text.empty()) return "needs a number, got an empty value";
        double value = 0;
        if (CLI::detail::lexical_cast(text, value) && !std::isfinite(value))
          return "must be a finite number, got '" + text + "'";
        return "";
      },
      "");
}

// --model's words and the kinds they name (nn/model_kind.h's table): the one place --model is parsed.
// A word outside the table is refused as the other choices are: "--model: resnet not in {mlp,cnn,gpt,llama}".
CLI::Validator model_kinds() {
  constexpr nn::ModelKind kinds[] = {nn::ModelKind::mlp, nn::ModelKind::cnn, nn::ModelKind::gpt, nn::ModelKind::llama};
  std::string choices;
  for (const nn::ModelKind kind : kinds) choices += (choices.empty() ? "{" : ",") + std::string(nn::model_name(kind));
  choices += "}";
  return CLI::Validator(
      [kinds, choices](std::string& word) -> std::string {
        for (const nn::ModelKind kind : kinds)
          if (word == nn::model_name(kind)) {
            word = std::to_string(static_cast<int>(kind));
            return "";
          }
        return word + " not in " + choices;
      },
      choices);
}

std::string model_text(const TrainConfig& c) {
  return std::string(nn::model_name(c.model));
}

// The decoder's switches, with Megatron-LM's flag names (docs/models.md).
void add_llama_options(CLI::App& command, TrainConfig& c, const std::string& group) {
  command.add_option("--normalization", c.normalization, "LayerNorm (gpt's) or RMSNorm (llama's), for either model")
      ->check(CLI::IsMember({"LayerNorm", "RMSNorm"}))
      ->group(group);
  command.add_option("--norm-epsilon", c.norm_epsilon, "The norms' epsilon (LayerNorm or RMSNorm; default 1e-5)")->group(group);
  command.add_option("--position-embedding-type", c.position_embedding_type,
                     "learned_absolute (gpt's) or rope (llama's: rotary embeddings), for either model")
      ->check(CLI::IsMember({"learned_absolute", "rope"}))
      ->group(group);
  command.add_option("--rotary-base", c.rotary_base, "RoPE's base (with rope; 10000, Llama 3: 500000)")->group(group);
  command.add_flag("--swiglu", c.swiglu, "SwiGLU MLP (llama's; for gpt too)")->group(group);
  command.add_flag("--group-query-attention", c.group_query_attention,
                   "Grouped-query attention with --num-query-groups key/value heads (gpt or llama)")
      ->group(group);
  command.add_option("--num-query-groups", c.num_query_groups,
                     "Key/value heads with --group-query-attention (divides --num-heads; 1: multi-query)")
      ->group(group);
  command.add_flag("--disable-bias-linear", c.disable_bias_linear, "No biases in linear layers (llama's; for gpt too)")
      ->group(group);
  command.add_flag("--untie-embeddings-and-output-weights", c.untie_embeddings,
                   "An LM head of its own instead of the embedding table (llama's; for gpt too)")
      ->group(group);
}

// A mixture of experts in the decoder (Megatron-Core's flag names).
void add_moe_options(CLI::App& command, TrainConfig& c, const std::string& group) {
  command.add_option("--num-experts", c.num_experts, "Experts per mixture-of-experts layer (gpt, llama; 0: dense MLPs)")
      ->check(whole_number_at_least(0))
      ->group(group);
  command.add_option("--moe-router-topk", c.moe_router_topk, "Experts each token goes to (default 2)")
      ->check(whole_number_at_least(1))
      ->group(group);
  command
      .add_option("--moe-layer-freq", c.moe_layer_freq,
                  "Which layers have experts: N (layers 0, N, 2N, ...; default 1: all) or a pattern [1,0,1,1]")
      ->group(group);
  command.add_option("--moe-ffn-hidden-size", c.moe_ffn_hidden_size, "Each expert's SwiGLU width (default: --ffn-hidden-size's)")
      ->check(whole_number_at_least(0))
      ->group(group);
  command.add_option("--moe-aux-loss-coeff", c.moe_aux_loss_coeff, "Load-balancing loss coefficient (Switch; e.g. 1e-2)")
      ->group(group);
  command.add_option("--moe-z-loss-coeff", c.moe_z_loss_coeff, "Router z-loss coefficient (ST-MoE; e.g. 1e-3)")->group(group);
  command
      .add_option("--moe-expert-capacity-factor", c.moe_expert_capacity_factor,
                  "Each expert keeps at most factor x tokens x topk / experts choices, the micro-batch's first "
                  "tokens (0: dropless)")
      ->group(group);
}

}  // namespace

void add_train_options(CLI::App& command, TrainConfig& c) {
  // A flag given twice keeps its last value, as with argparse (Megatron,
  // torchrun): launch scripts append overrides to a list of defaults.
  command.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  command.add_option("--config", c.config_file, "TOML file of settings (keys are flag names); flags override it")
      ->check(CLI::ExistingFile);

  const std::string model = "Model";
  command.add_option("--model", c.model, "Model: mlp, cnn, gpt or llama")
      ->transform(model_kinds())
      ->group(model);
  command.add_option("--hidden", c.hidden, "MLP hidden sizes, e.g. 1024,1024")
      ->delimiter(',')
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->group(model);
  command.add_option("--vocab-size", c.vocab_size,
                     "GPT vocabulary size (default: the dataset's, padded to --make-vocab-size-divisible-by; 256 "
                     "with --synthetic)")
      ->group(model);
  command.add_option("--make-vocab-size-divisible-by", c.make_vocab_size_divisible_by,
                     "Without --vocab-size: pad the dataset's vocabulary to a multiple of this (as Megatron-LM)")
      ->group(model);
  command.add_option("--seq-length", c.seq_length, "GPT context length")->group(model);
  command.add_option("--num-layers", c.num_layers, "GPT Transformer blocks")->group(model);
  command.add_option("--num-heads", c.num_heads, "GPT attention heads")->group(model);
  command.add_option("--hidden-size", c.hidden_size, "GPT model width")->group(model);
  command.add_option("--ffn-hidden-size", c.ffn_hidden_size, "MLP width (0: gpt 4 x hidden size; llama 8/3 x hidden size rounded up to a multiple of 256)")->group(model);
  command.add_option("--hidden-dropout", c.hidden_dropout, "Dropout after attention and MLP (GPT)")->group(model);
  command
      .add_option("--attention-dropout", c.attention_dropout,
                  "Dropout on the attention probabilities, in training (gpt, llama; GPT-2's attn_pdrop)")
      ->group(model);
  command.add_flag("--recompute", c.recompute, "Recompute each Transformer block's activations in backward")
      ->group(model);
  add_llama_options(command, c, model);
  add_moe_options(command, c, "Mixture of experts (gpt, llama)");

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
  command
      .add_option("--warmup-steps", c.warmup_steps,
                  "Steps of linear warm-up from 0 to --lr (Megatron's: update n gets lr*n/W)")
      ->group(schedule);
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
      ->check(whole_number_at_least(1))
      ->group(parallel);
  command
      .add_option("--context-parallel-size,--cp", c.context_parallel,
                  "Split every sequence over C ranks (gpt, llama): rank r holds chunks r and 2C-1-r of 2C, "
                  "attention runs as ring attention; --seq-length a multiple of 2C")
      ->check(whole_number_at_least(1))
      ->group(parallel);
  command
      .add_option("--expert-model-parallel-size,--ep", c.expert_parallel,
                  "Split each mixture-of-experts layer's experts over P ranks of the data-parallel ones (tokens go to "
                  "their experts and back by all-to-all); --num-experts a multiple of P")
      ->check(whole_number_at_least(1))
      ->group(parallel);
  command
      .add_option("--pipeline-parallel,--pp", c.pipeline_parallel,
                  "Split the model's layers into P pipeline stages (gpt, llama, mlp); micro-batches = global batch / "
                  "(micro-batch x dp)")
      ->check(whole_number_at_least(1))
      ->group(parallel);
  command
      .add_option("--rank-order", c.rank_order,
                  "The layout's axes from the fastest-varying to the slowest (Megatron-Core's default tp-cp-ep-dp-pp: "
                  "tensor-parallel ranks are neighbours on a node); axes of size 1 may be left out")
      ->group(parallel);
  command
      .add_option("--pipeline-schedule", c.pipeline_schedule,
                  "gpipe, 1f1b (at most P micro-batches in flight), zb-h1 (1F1B's memory, backward split in input and "
                  "weight gradients, a third of its bubble) or zbv (two chunks per stage in a V, about no bubble)")
      ->check(CLI::IsMember({"gpipe", "1f1b", "zb-h1", "zbv"}))
      ->group(parallel);
  command
      .add_option("--pipeline-split", c.pipeline_split,
                  "Stage boundaries in layers, e.g. 0,5,9,12 for 3 stages of a 12-layer GPT (default: balanced by "
                  "parameter count)")
      ->group(parallel);
  command
      .add_option("--virtual-pipeline-stages,--num-virtual-stages-per-pipeline-rank", c.virtual_pipeline_stages,
                  "Interleaved 1F1B (gpt, llama): V model chunks per pipeline stage, the bubble shrinking to (P-1)/(V*M+P-1); "
                  "micro-batches per step a multiple of P")
      ->check(whole_number_at_least(1))
      ->group(parallel);
  command
      .add_flag("--sequence-parallel", c.sequence_parallel,
                "With --tensor-parallel K > 1: shard LayerNorm and dropout activations along the sequence")
      ->group(parallel);
  command
      .add_option("--zero", c.zero,
                  "What is sharded over the data-parallel ranks: 0 nothing; 1 optimizer state (ZeRO-1); 2 and "
                  "gradients (ZeRO-2); 3 and parameters, gathered per block as used (ZeRO-3, FSDP)")
      ->check(CLI::IsMember({0, 1, 2, 3}))
      ->group(parallel);
  command
      .add_option("--zero-prefetch", c.zero_prefetch,
                  "With --zero 2/3: units (blocks, embeddings) gathered ahead of use and gradient reductions left in "
                  "flight; 0 overlaps nothing and holds the least memory")
      ->check(whole_number_at_least(0))
      ->group(parallel);
  command
      .add_flag("--estimate-memory", c.estimate_memory,
                "Print every rank's predicted parameter, gradient and optimizer-state bytes for this configuration "
                "(launch it as you would train) and exit without training")
      ->group(parallel);
  command
      .add_flag("--plan", c.plan,
                "Pick the layout axes not given (tp, pp, cp, ZeRO, micro-batch, schedule, recompute) by `tessera "
                "plan`'s prediction for --cluster")
      ->group(parallel);
  command
      .add_option("--cluster", c.cluster,
                  "With --plan (and for `tessera plan`): 8xH100-SXM:NVLink4,IB-NDR400x8:nodes=64, a TOML file, or "
                  "local (this allocation as `tessera selfcheck --cluster` measured it: $TESSERA_CLUSTER_FILE or "
                  "./tessera-cluster.toml)")
      ->group(parallel);
  command
      .add_option("--bucket-size-mb", c.bucket_size_mb,
                  "MiB of f32 gradients per all-reduce bucket (each starts as soon as backward fills it)")
      ->group(parallel);
  command
      .add_option("--comm-timeout", c.comm_timeout,
                  "Seconds a collective or transfer may take before the job stops, naming the stalled ranks "
                  "(0: no limit)")
      ->check(timeout_seconds())
      ->group(parallel);
  command
      .add_option("--comm-backend", c.comm_backend,
                  "auto (NCCL for device tensors when built, MPI for host tensors), mpi, or nccl (as auto, but NCCL is "
                  "required)")
      ->check(CLI::IsMember({"auto", "mpi", "nccl"}))
      ->group(parallel);

  const std::string samples = "Samples during training (GPT)";
  command
      .add_option("--sample-interval", c.sample_interval,
                  "Print text the model generates from --sample-prompt every N steps and at the end (0: never)")
      ->group(samples);
  command
      .add_option("--sample-prompt", c.sample_prompt,
                  "The text samples continue, encoded with --data's tokenizer (default: a newline)")
      ->group(samples);
  command.add_option("--sample-tokens", c.sample_tokens, "Tokens per sample")->capture_default_str()->group(samples);
  command
      .add_option("--sample-temperature", c.sample_temperature, "Softmax temperature of the samples (0: greedy)")
      ->capture_default_str()
      ->group(samples);
  command.add_option("--sample-top-k", c.sample_top_k, "Sample from the k most likely tokens (0: all)")
      ->group(samples);

  const std::string output = "Evaluation and output";
  command.add_option("--eval-interval", c.eval_interval, "Steps between evaluations (0: every epoch and at the end)")
      ->group(output);
  command.add_option("--eval-iters", c.eval_iters, "Batches per evaluation (0: the whole eval set)")->group(output);
  command.add_option("--log-interval", c.log_interval, "Steps between progress lines when not on a terminal")
      ->group(output);
  command.add_option("--metrics", c.metrics, "Write metrics as JSON lines to this file")->group(output);
  command
      .add_flag("--katib-metrics", c.katib_metrics,
                "Also print Katib's `name=value` lines on stdout every log interval (on by itself when Katib's "
                "StdOut collector reads stdout)")
      ->group(output);
  command
      .add_option("--metrics-port", c.metrics_port,
                  "Rank 0 serves every rank's metrics for Prometheus at http://HOST:P/metrics, refreshed every "
                  "--log-interval steps (0: off)")
      ->check(CLI::Range(0, 65535))
      ->group(output);
  command
      .add_option("--metrics-push", c.metrics_push,
                  "Rank 0 pushes the same metrics to this Prometheus Pushgateway every --log-interval steps "
                  "(http://HOST:9091; job tessera)")
      ->group(output);
  command
      .add_option("--straggler-threshold", c.straggler_threshold,
                  "Every --log-interval steps, name a rank whose compute time per step is this fraction above the "
                  "median of all ranks' (0: off)")
      ->capture_default_str()
      ->group(output);
  command
      .add_option("--mlflow-uri", c.mlflow_uri,
                  "Rank 0 records the run in this MLflow tracking server (http(s)://HOST:5000): every setting as a "
                  "parameter, the metrics of every step, the curves and metrics file at the end; a server that fails "
                  "is a warning, never a stop. MLFLOW_TRACKING_TOKEN or _USERNAME/_PASSWORD authenticate; "
                  "MLFLOW_RUN_ID goes on with an existing run")
      ->group(output);
  command
      .add_option("--mlflow-experiment", c.mlflow_experiment,
                  "The MLflow experiment, created when missing (default: $MLFLOW_EXPERIMENT_NAME, else Default)")
      ->group(output);
  command.add_option("--mlflow-run-name", c.mlflow_run_name, "The MLflow run's name (default: the server picks one)")
      ->group(output);
  command
      .add_option("--mlflow-timeout", c.mlflow_timeout,
                  "Seconds the end of training waits for the MLflow server to take what is still queued (each "
                  "request times out after at most 10 s)")
      ->capture_default_str()
      ->group(output);
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
  command
      .add_option("--save-interval-minutes", c.save_interval_minutes,
                  "Also save at the first step boundary M minutes after the last save (or the start), by rank 0's "
                  "clock, every rank at the same step (0: off)")
      ->group(checkpoints);
  command.add_option("--keep-checkpoints", c.keep_checkpoints, "Keep only the newest K checkpoints (0: keep all)")
      ->group(checkpoints);
  command
      .add_option("--init-from", c.init_from,
                  "Start from these weights: a safetensors file of `tessera export` (Tessera's or Hugging Face "
                  "GPT-2's names), loaded under any layout; a run that resumes a checkpoint ignores it")
      ->group(checkpoints);
  command
      .add_option("--ckpt-format", c.ckpt_format,
                  "sharded: every rank writes the elements it owns into its own file and rank 0 an index that shows "
                  "each tensor whole (needs a --save directory every rank can write); gathered: rank 0 receives "
                  "everything and writes one file (a --save directory only rank 0's node sees)")
      ->check(CLI::IsMember({"sharded", "gathered"}))
      ->group(checkpoints);
  command
      .add_flag("--async-save,!--no-async-save", c.async_save,
                "Write sharded checkpoints on a background thread from a host copy of what each rank owns (costs "
                "that copy's memory until written) while training goes on; the final save and saves on a signal "
                "are synchronous (default: on)")
      ->group(checkpoints);
  command
      .add_option("--save-timeout", c.save_timeout,
                  "Seconds a checkpoint save may take (every rank waits for rank 0's writes) before the job stops, in "
                  "place of --comm-timeout during saves (0: no limit)")
      ->check(timeout_seconds())
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

  for (CLI::Option* option : command.get_options()) {
    const std::string type = option->get_type_name();
    if (type == "INT" || type == "UINT" || type == "FLOAT") option->check(a_finite_number());
  }
}

namespace {

// One `key = value` of a --config file, its value as the text a flag takes.
struct ConfigEntry {
  std::string key;                  // as written
  std::vector<std::string> values;  // the value, or an array's elements
  bool array = false;
  int line = 0;  // where the key is
};

// A TOML scalar as a flag's text: strings as they are, integers and booleans
// as written, floats in the shortest form that reads back to the same double;
// nothing for dates and times, which no flag takes.
std::optional<std::string> flag_text(const toml::node& node) {
  if (const auto* text = node.as_string()) return text->get();
  if (const auto* integer = node.as_integer()) return std::to_string(integer->get());
  if (const auto* flag = node.as_boolean()) return std::string(flag->get() ? "true" : "false");
  if (const auto* number = node.as_floating_point()) return shortest_text(number->get());
  return std::nullopt;
}

// The settings of `table` and of the tables inside it ([train] headers and
// dotted keys apply like top-level keys; inline tables are refused), appended
// to `entries`.
void collect_settings(const toml::table& table, const std::string& file, std::vector<ConfigEntry>& entries) {
  for (const auto& [key, node] : table) {
    ConfigEntry entry{std::string(key.str()), {}, false, int(key.source().begin.line)};
    const std::string where = "--config " + file + " line " + std::to_string(entry.line) + ": '" + entry.key + "' ";
    if (const toml::table* inner = node.as_table()) {
      TESSERA_CHECK(!inner->is_inline(), where, "is an inline table ({...}); write one key = value per line");
      collect_settings(*inner, file, entries);
      continue;
    }
    if (const toml::array* array = node.as_array()) {
      entry.array = true;
      for (const toml::node& element : *array) {
        const std::optional<std::string> text = flag_text(element);
        TESSERA_CHECK(text.has_value(), where,
                      "holds an array of arrays, tables or dates; a flag takes numbers, text or true/false");
        entry.values.push_back(*text);
      }
    } else {
      const std::optional<std::string> text = flag_text(node);
      TESSERA_CHECK(text.has_value(), where, "is a date or time; a flag takes numbers, text or true/false");
      entry.values.push_back(*text);
    }
    entries.push_back(std::move(entry));
  }
}

// The settings of a --config file in the order of their lines, read by
// toml++ (full TOML 1.0). A file that is not valid TOML (an unterminated
// string or array, a key set twice, a bare word as a value) is refused with
// the line and toml++'s description.
std::vector<ConfigEntry> read_config_settings(const std::string& file, std::string_view text) {
  toml::table root;
  try {
    root = toml::parse(text, file);
  } catch (const toml::parse_error& error) {
    // toml++'s words for a bare word as a value (model = gpt), which CLI11's reader took.
    const bool bare_word = error.description().find("could not determine value type") != std::string_view::npos;
    TESSERA_THROW("--config ", file, " line ", error.source().begin.line, ": not valid TOML: ", error.description(),
                  bare_word ? " (text values need quotes: model = \"gpt\")" : "");
  }
  std::vector<ConfigEntry> entries;
  collect_settings(root, file, entries);
  std::stable_sort(entries.begin(), entries.end(),
                   [](const ConfigEntry& a, const ConfigEntry& b) { return a.line < b.line; });
  return entries;
}

// A name as the flag it would be: no leading dashes, nothing from '=' on,
// lower case, '_' as '-' ("--Learning_Rate=0.1" -> "learning-rate").
std::string normalized(std::string_view text) {
  while (!text.empty() && text.front() == '-') text.remove_prefix(1);
  text = text.substr(0, text.find('='));
  std::string name(text);
  for (char& ch : name) {
    if (ch == '_') ch = '-';
    if (ch >= 'A' && ch <= 'Z') ch = char(ch - 'A' + 'a');
  }
  return name;
}

// Optimal string alignment distance: insertions, deletions, substitutions
// and swaps of neighbours ("trian" is one from "train").
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// Names of other trainers (Megatron-LM, PyTorch/torchrun, DeepSpeed, nanoGPT,
// Hugging Face Trainer and Accelerate) and common guesses, as Tessera's flag
// (and value); or only a note where Tessera has no flag for it.
struct Alias {
  const char* name;  // normalized
  const char* flag;
  const char* value;
  const char* note;
};

constexpr Alias kAliases[] = {
    {"learning-rate", "--lr", "", ""},
    {"min-learning-rate", "--min-lr", "", ""},
    {"batch-size", "--micro-batch-size", "", "samples per rank per forward/backward pass"},
    {"per-device-train-batch-size", "--micro-batch-size", "", ""},
    {"train-micro-batch-size-per-gpu", "--micro-batch-size", "", ""},
    {"train-batch-size", "--global-batch-size", "", "samples per optimizer step over all ranks"},
    {"gradient-accumulation-steps", "--global-batch-size", "",
     "the samples of one optimizer step: micro-batch x data-parallel ranks x accumulation steps"},
    {"train-iters", "--train-steps", "", ""},
    {"max-steps", "--train-steps", "", ""},
    {"max-iters", "--train-steps", "", ""},
    {"num-steps", "--train-steps", "", ""},
    {"steps", "--train-steps", "", ""},
    {"iterations", "--train-steps", "", ""},
    {"num-train-epochs", "--epochs", "", ""},
    {"lr-warmup-iters", "--warmup-steps", "", ""},
    {"lr-warmup-steps", "--warmup-steps", "", ""},
    {"warmup-iters", "--warmup-steps", "", ""},
    {"warmup", "--warmup-steps", "", ""},
    {"lr-decay-iters", "", "", "the cosine decay always spans --train-steps"},
    {"lr-scheduler-type", "--lr-decay-style", "", ""},
    {"lr-scheduler", "--lr-decay-style", "", ""},
    {"lr-schedule", "--lr-decay-style", "", ""},
    {"max-grad-norm", "--clip-grad", "", ""},
    {"grad-clip", "--clip-grad", "", ""},
    {"gradient-clipping", "--clip-grad", "", ""},
    {"clip-grad-norm", "--clip-grad", "", ""},
    {"adam-epsilon", "--adam-eps", "", ""},
    {"beta1", "--adam-beta1", "", ""},
    {"beta2", "--adam-beta2", "", ""},
    {"momentum", "--sgd-momentum", "", ""},
    {"optim", "--optimizer", "", ""},
    {"wd", "--weight-decay", "", ""},
    {"num-attention-heads", "--num-heads", "", ""},
    {"n-head", "--num-heads", "", ""},
    {"n-heads", "--num-heads", "", ""},
    {"heads", "--num-heads", "", ""},
    {"num-hidden-layers", "--num-layers", "", ""},
    {"n-layer", "--num-layers", "", ""},
    {"n-layers", "--num-layers", "", ""},
    {"layers", "--num-layers", "", ""},
    {"n-embd", "--hidden-size", "", ""},
    {"d-model", "--hidden-size", "", ""},
    {"embed-dim", "--hidden-size", "", ""},
    {"hidden-dim", "--hidden-size", "", ""},
    {"intermediate-size", "--ffn-hidden-size", "", ""},
    {"ffn-dim", "--ffn-hidden-size", "", ""},
    {"d-ff", "--ffn-hidden-size", "", ""},
    {"max-position-embeddings", "--seq-length", "", ""},
    {"block-size", "--seq-length", "", ""},
    {"n-ctx", "--seq-length", "", ""},
    {"context-length", "--seq-length", "", ""},
    {"seq-len", "--seq-length", "", ""},
    {"max-seq-length", "--seq-length", "", ""},
    {"max-seq-len", "--seq-length", "", ""},
    {"sequence-length", "--seq-length", "", ""},
    {"padded-vocab-size", "--vocab-size", "", ""},
    {"dropout", "--hidden-dropout", "", ""},
    {"hidden-dropout-prob", "--hidden-dropout", "", ""},
    {"resid-pdrop", "--hidden-dropout", "", ""},
    {"attn-pdrop", "--attention-dropout", "", ""},
    {"attention-probs-dropout-prob", "--attention-dropout", "", ""},
    {"recompute-activations", "--recompute", "", ""},
    {"recompute-granularity", "--recompute", "", "Tessera recomputes whole Transformer blocks"},
    {"checkpoint-activations", "--recompute", "", ""},
    {"gradient-checkpointing", "--recompute", "", ""},
    {"activation-checkpointing", "--recompute", "", ""},
    {"tensor-model-parallel-size", "--tensor-parallel", "", ""},
    {"tensor-parallel-size", "--tensor-parallel", "", ""},
    {"tp-size", "--tensor-parallel", "", ""},
    {"pipeline-model-parallel-size", "--pipeline-parallel", "", ""},
    {"pipeline-parallel-size", "--pipeline-parallel", "", ""},
    {"pp-size", "--pipeline-parallel", "", ""},
    {"sequence-parallelism", "--sequence-parallel", "", ""},
    {"use-distributed-optimizer", "--zero", "1", "the optimizer state sharded over the data-parallel ranks"},
    {"zero-stage", "--zero", "", ""},
    {"zero-optimization-stage", "--zero", "", ""},
    {"fsdp", "--zero", "3", "parameters, gradients and optimizer state sharded over the data-parallel ranks"},
    {"prefetch-count", "--zero-prefetch", "", ""},
    {"forward-prefetch", "--zero-prefetch", "", ""},
    {"backward-prefetch", "--zero-prefetch", "", ""},
    {"bf16", "--precision", "bf16", ""},
    {"fp16", "--precision", "fp16", ""},
    {"fp32", "--precision", "fp32", ""},
    {"mixed-precision", "--precision", "", ""},
    {"dtype", "--precision", "", ""},
    {"random-seed", "--seed", "", ""},
    {"save-dir", "--save", "", ""},
    {"output-dir", "--save", "", ""},
    {"checkpoint-dir", "--save", "", ""},
    {"load", "--resume", "", "a checkpoint or --save directory, or auto"},
    {"resume-from-checkpoint", "--resume", "", ""},
    {"save-steps", "--save-interval", "", ""},
    {"checkpoint-interval", "--save-interval", "", ""},
    {"save-total-limit", "--keep-checkpoints", "", ""},
    {"use-dist-ckpt", "--ckpt-format", "sharded", "every rank writes what it owns"},
    {"ckpt-fully-parallel-save", "--ckpt-format", "sharded", "every rank writes what it owns"},
    {"eval-steps", "--eval-interval", "", ""},
    {"logging-steps", "--log-interval", "", ""},
    {"data-path", "--data", "", "a file made by `tessera prepare`"},
    {"train-data-path", "--data", "", ""},
    {"train-file", "--data", "", ""},
    {"train-data", "--data", "", ""},
    {"dataset", "--data", "", ""},
    {"valid-data-path", "--eval-data", "", ""},
    {"validation-file", "--eval-data", "", ""},
    {"valid-data", "--eval-data", "", ""},
    {"val-data", "--eval-data", "", ""},
    {"distributed-timeout-minutes", "--comm-timeout", "", "in seconds"},
    {"timeout", "--comm-timeout", "", ""},
    {"num-threads", "--threads", "", ""},
    {"tensorboard-dir", "--metrics", "", "a JSON-lines file; `tessera plot` draws it"},
    {"log-dir", "--metrics", "", ""},
    {"profile", "--trace", "", "a Chrome-trace/Perfetto timeline file"},
    {"config-file", "--config", "", ""},
    {"model-type", "--model", "", ""},
    {"arch", "--model", "", ""},
    {"hidden-sizes", "--hidden", "", ""},
    {"layer-sizes", "--hidden", "", ""},
    {"gpu", "--device", "cuda", ""},
    {"cuda", "--device", "cuda", ""},
    {"nproc-per-node", "", "", "the launcher starts the ranks: mpirun -np N or srun -n N, one rank per GPU"},
    {"nnodes", "", "", "the launcher starts the ranks: mpirun -np N or srun -N NODES -n N"},
    {"world-size", "", "", "the launcher starts the ranks: mpirun -np N or srun -n N"},
    {"gpus", "", "", "the launcher starts the ranks: mpirun -np N or srun -n N, one rank per GPU"},
    {"num-gpus", "", "", "the launcher starts the ranks: mpirun -np N or srun -n N, one rank per GPU"},
};

// Flags of `command` (long names without dashes, --help aside), in the order they were added.
std::vector<std::string> flag_names(const CLI::App& command) {
  std::vector<std::string> names;
  for (const CLI::Option* option : command.get_options())
    if (option != command.get_help_ptr())
      for (const std::string& name : option->get_lnames()) names.push_back(name);
  return names;
}

std::string join(const std::vector<std::string>& parts, const std::string& separator) {
  std::string text;
  for (size_t i = 0; i < parts.size(); ++i) text += (i ? separator : "") + parts[i];
  return text;
}

}  // namespace

std::string closest_name(const std::string& typo, const std::vector<std::string>& names) {
  if (typo.size() > 64) return "";  // not a typo of a name, and the distances would cost time and memory
  // A typo of a short name is one edit; of a longer one, two or three.
  const size_t allowed = typo.size() <= 3 ? 1 : typo.size() <= 7 ? 2 : 3;
  std::string best;
  size_t best_distance = allowed + 1;
  for (const std::string& name : names) {
    const size_t distance = edit_distance(typo, name);
    if (distance < best_distance && distance < name.size()) {
      best = name;
      best_distance = distance;
    }
  }
  return best;
}

FlagSuggestion suggest_flag(const CLI::App& command, const std::string& unknown) {
  const std::string name = normalized(unknown);
  if (name.empty() || name.size() > 64) return {};
  const std::vector<std::string> flags = flag_names(command);
  const auto is_flag = [&](const std::string& flag) {
    return std::find(flags.begin(), flags.end(), flag) != flags.end();
  };
  // --micro_batch_size, -lr: the flag itself, spelled otherwise.
  if (is_flag(name)) return {"--" + name, "", ""};
  for (const Alias& alias : kAliases)
    if (name == alias.name && (*alias.flag == '\0' || is_flag(alias.flag + 2)))
      return {alias.flag, alias.value, alias.note};
  // --micro-batch: the only flag it begins.
  if (name.size() >= 4) {
    std::vector<std::string> extended;
    for (const std::string& flag : flags)
      if (flag.compare(0, name.size(), name) == 0) extended.push_back(flag);
    if (extended.size() == 1) return {"--" + extended.front(), "", ""};
  }
  // A typo of a flag, or of another trainer's name for one.
  std::vector<std::string> candidates = flags;
  for (const Alias& alias : kAliases)
    if (*alias.flag == '\0' || is_flag(alias.flag + 2)) candidates.push_back(alias.name);
  const std::string near = closest_name(name, candidates);
  if (near.empty()) return {};
  if (is_flag(near)) return {"--" + near, "", ""};
  for (const Alias& alias : kAliases)
    if (near == alias.name) return {alias.flag, alias.value, alias.note};
  return {};
}

std::string suggestion_text(const FlagSuggestion& suggestion, bool as_key) {
  if (suggestion.empty()) return "";
  if (suggestion.flag.empty()) return suggestion.note;
  std::string text = "did you mean `";
  if (as_key) {
    text += suggestion.flag.substr(2);
    if (!suggestion.value.empty()) {
      const bool number = suggestion.value.find_first_not_of("0123456789") == std::string::npos;
      text += " = " + (number ? suggestion.value : "\"" + suggestion.value + "\"");
    }
  } else {
    text += suggestion.flag + (suggestion.value.empty() ? "" : " " + suggestion.value);
  }
  text += "`?";
  if (!suggestion.note.empty()) text += " (" + suggestion.note + ")";
  return text;
}

ConfigFileLines apply_config_file(CLI::App& command, TrainConfig& config) {
  ConfigFileLines applied;
  if (config.config_file.empty()) return applied;
  const std::string file = config.config_file;
  std::ifstream in(file, std::ios::binary);
  TESSERA_CHECK(in.is_open(), "--config ", file, ": cannot open it: ", std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  TESSERA_CHECK(!in.bad(), "--config ", file, ": cannot read it: ", std::strerror(errno));

  std::map<std::string, int> seen;  // flag -> line, of every key of the file
  for (const ConfigEntry& entry : read_config_settings(file, text.str())) {
    const std::string where = "--config " + file + " line " + std::to_string(entry.line) + ": ";
    std::string name = entry.key;
    std::replace(name.begin(), name.end(), '_', '-');
    TESSERA_CHECK(name != "config", where, "a --config file cannot name another; give one --config");
    CLI::Option* option = command.get_option_no_throw("--" + name);
    if (option == nullptr || option == command.get_help_ptr()) {
      const std::string hint = suggestion_text(suggest_flag(command, entry.key), /*as_key=*/true);
      TESSERA_THROW(where, "unknown setting '", entry.key, "'", hint.empty() ? "" : "; " + hint,
                    " (keys are the flags of `tessera train --help` without the dashes)");
    }
    const auto [first, fresh] = seen.emplace(option->get_name(), entry.line);
    TESSERA_CHECK(fresh, where, "'", entry.key, "' is set twice (first on line ", first->second, "); keep one");
    if (option->count() > 0) continue;  // given on the command line: the flag wins

    const bool is_flag = option->get_items_expected_max() == 0;  // true/false
    const bool takes_list = option->get_items_expected_max() > 1;
    TESSERA_CHECK(!entry.array || takes_list, where, "'", entry.key, "' takes one value, but is given an array ([",
                  join(entry.values, ", "), "]); write ", entry.key, " = ", is_flag ? "true" : "VALUE");
    TESSERA_CHECK(!entry.array || !entry.values.empty(), where, "'", entry.key,
                  "' is given an empty array; list at least one value (", entry.key, " = [1024, 1024])");
    TESSERA_CHECK(!is_flag || entry.values.front() == "true" || entry.values.front() == "false", where, "'", entry.key,
                  "' is true or false, not '", entry.values.front(), "'");
    try {
      option->add_result(entry.values);
      option->run_callback();
    } catch (const CLI::Error& error) {
      TESSERA_THROW(where, "bad value for '", entry.key, "': ", error.what());
    }
    applied[option->get_name()] = entry.line;
  }
  return applied;
}

// The decoder's switches (Megatron's names): each works on its own for
// either language model (--model gpt or llama, whose defaults they change); a
// combination that cannot work is refused naming both flags; the MLP and the
// CNN have none of them.
template <typename Given, typename Refuse>
void refuse_decoder_choices(nn::ModelKind kind, const TrainConfig& c, const Given& given, const Refuse& refuse_if) {
  if (!nn::model_traits(kind).reads_tokens) {
    const std::string why = "a choice of the language models' layers, and --model " + model_text(c) +
                            " has none; use --model gpt or llama";
    for (const char* flag : {"--normalization", "--position-embedding-type", "--norm-epsilon", "--rotary-base",
                             "--num-query-groups"})
      refuse_if(flag, true, why);
    refuse_if("--swiglu", c.swiglu, why);
    refuse_if("--group-query-attention", c.group_query_attention, why);
    refuse_if("--disable-bias-linear", c.disable_bias_linear, why);
    refuse_if("--untie-embeddings-and-output-weights", c.untie_embeddings, why);
    return;
  }
  const bool rope = c.position_embedding_type.empty() ? nn::decoder_defaults(kind).rotary
                                                      : c.position_embedding_type == "rope";
  refuse_if("--rotary-base", !rope,
            "sets the base of rotary embeddings, and the positions are learned (--position-embedding-type " +
                std::string(given("--position-embedding-type") ? "learned_absolute" : "learned_absolute, --model " +
                                                                                         model_text(c) + "'s default") +
                "); add --position-embedding-type rope, or drop --rotary-base");
  refuse_if("--num-query-groups", !c.group_query_attention,
            "sets the key/value heads of grouped-query attention, which --group-query-attention turns on; add "
            "--group-query-attention, or drop it");
  if (c.group_query_attention && !given("--num-query-groups"))
    TESSERA_THROW("--group-query-attention needs --num-query-groups G (key/value heads, dividing --num-heads ",
                  c.num_heads, "; 1: multi-query)");
}

namespace {

// The experts per block: --num-experts, else those of a Hugging Face Mixtral
// --init-from names (its config.json read here; 0 when it is not one or
// cannot be read: loading it reports why).
int64_t experts_of(const TrainConfig& c) {
  if (c.num_experts > 0 || c.init_from.empty() || c.model != nn::ModelKind::llama) return c.num_experts;
  std::error_code error;
  if (!std::filesystem::is_regular_file(std::filesystem::path(c.init_from) / "config.json", error)) return 0;
  try {
    return io::read_hf_llama_config(c.init_from).num_local_experts;
  } catch (const Error&) {
    return 0;
  }
}

}  // namespace

// The mixture-of-experts flags need experts (--num-experts, or a Mixtral's
// --init-from, in a language model).
template <typename Refuse>
void refuse_expert_settings(const TrainConfig& c, const Refuse& refuse_if) {
  if (!nn::model_traits(c.model).reads_tokens)
    refuse_if("--num-experts", c.num_experts > 0,
              "experts replace the MLPs of a language model's blocks, and --model " + model_text(c) +
                  " has none; use --model gpt or llama");
  const int64_t experts = experts_of(c);
  const std::string why = experts > 0 ? "" : "a setting of the mixture-of-experts layers, and there are none; add "
                                             "--num-experts E, or drop it";
  if (experts > 0 && nn::model_traits(c.model).reads_tokens) return;
  for (const char* flag : {"--moe-router-topk", "--moe-layer-freq", "--moe-ffn-hidden-size", "--moe-aux-loss-coeff",
                           "--moe-z-loss-coeff", "--moe-expert-capacity-factor"})
    refuse_if(flag, true, why.empty() ? "a setting of the mixture-of-experts layers, which --model " + model_text(c) +
                                            " cannot have" : why);
  refuse_if("--expert-model-parallel-size", c.expert_parallel > 1,
            "splits the experts of mixture-of-experts layers over ranks, and there are none; add --num-experts E "
            "(a multiple of it), or drop it");
}

void record_given_flags(const CLI::App& command, TrainConfig& c) {
  for (const CLI::Option* option : command.get_options())
    if (option->count() > 0) c.given.insert(option->get_name());
}

void refuse_unused_settings(const CLI::App& command, const TrainConfig& c, const ConfigFileLines& from_file) {
  const nn::ModelKind kind = c.model;
  std::vector<std::string> problems;
  const auto given = [&](const std::string& flag) {
    const CLI::Option* option = command.get_option_no_throw(flag);
    return option != nullptr && option->count() > 0;
  };
  // `unused`: what the run would do without the flag is what it does with it.
  // Boolean flags count only when true (--recompute=false asks for nothing).
  const auto refuse_if = [&](const std::string& flag, bool unused, const std::string& why) {
    const CLI::Option* option = command.get_option_no_throw(flag);
    if (option == nullptr || option->count() == 0 || !unused) return;
    std::string text = option->get_name();
    if (option->get_items_expected_max() > 0) text += " " + join(option->results(), ",");
    if (const auto line = from_file.find(option->get_name()); line != from_file.end())
      text += " (" + c.config_file + " line " + std::to_string(line->second) + ")";
    problems.push_back(text + ": " + why);
  };
  const auto setting = [&](const std::string& flag, const std::string& value) {
    return flag + " " + value + (given(flag) ? "" : " (the default)");
  };

  const bool language_model = nn::model_traits(kind).reads_tokens;
  refuse_decoder_choices(kind, c, given, refuse_if);
  refuse_expert_settings(c, refuse_if);
  if (!language_model) {
    const std::string model = setting("--model", model_text(c));
    const bool mlp = kind == nn::ModelKind::mlp;
    const std::string widths = mlp ? "; the MLP's layer widths are --hidden" : "; the CNN's layers are fixed";
    std::string deep = "--hidden";  // the MLP with --num-layers hidden layers of its first width
    if (c.num_layers >= 1 && c.num_layers <= 8) {
      deep += " ";
      for (int64_t i = 0; i < c.num_layers; ++i)
        deep += (i ? "," : "") + std::to_string(c.hidden.empty() ? 1024 : c.hidden.front());
    }
    refuse_if("--hidden-size", true,
              "the GPT's width, and " + model + " does not use it" +
                  (mlp ? widths + " (e.g. --hidden " + std::to_string(c.hidden_size) + "," +
                             std::to_string(c.hidden_size) + ")"
                       : widths));
    refuse_if("--num-layers", true,
              "the GPT's number of Transformer blocks, and " + model + " does not use it" +
                  (mlp ? "; the MLP has one hidden layer per width of --hidden (e.g. " + deep + ")" : widths));
    refuse_if("--num-heads", true, "the GPT's attention heads, and " + model + " does not use it" + widths);
    refuse_if("--ffn-hidden-size", true,
              "the width of the GPT's feed-forward blocks, and " + model + " does not use it" + widths);
    refuse_if("--seq-length", true, "the GPT's context length, and " + model + " does not use it");
    refuse_if("--vocab-size", true, "the GPT's vocabulary, and " + model + " does not use it");
    refuse_if("--make-vocab-size-divisible-by", true, "pads the GPT's vocabulary, and " + model + " does not use it");
    refuse_if("--hidden-dropout", true,
              "dropout in the GPT's blocks, and " + model + " does not use it (it has no dropout)");
    refuse_if("--attention-dropout", true,
              "dropout on the attention probabilities of the GPT and the Llama, and " + model + " has no attention");
    refuse_if("--recompute", c.recompute,
              "recomputes the GPT's Transformer blocks in backward, and " + model + " has none");
  }
  if (language_model && given("--vocab-size"))
    refuse_if("--make-vocab-size-divisible-by", true,
              "pads the dataset's vocabulary when --vocab-size is not given, and --vocab-size " +
                  std::to_string(c.vocab_size) + " is; drop one of them");
  if (kind != nn::ModelKind::mlp)
    refuse_if("--hidden", true,
              "the MLP's layer widths, and " + setting("--model", model_text(c)) + " does not use it" +
                  (language_model ? "; a language model's width is --hidden-size and its depth --num-layers"
                                              : "; the CNN's layers are fixed"));
  if (c.optimizer != "sgd") {
    const std::string optimizer = setting("--optimizer", c.optimizer);
    refuse_if("--nesterov", c.nesterov,
              "Nesterov momentum is SGD's, and " + optimizer + " does not use it; add --optimizer sgd, or drop it");
    refuse_if("--sgd-momentum", true,
              "SGD's momentum, and " + optimizer +
                  " does not use it (AdamW's are --adam-beta1 and --adam-beta2); add --optimizer sgd, or drop it");
  }
  if (c.optimizer != "adamw")
    for (const char* flag : {"--adam-beta1", "--adam-beta2", "--adam-eps"})
      refuse_if(flag, true,
                "an AdamW setting, and --optimizer " + c.optimizer +
                    " does not use it (SGD's momentum is --sgd-momentum); drop it, or use --optimizer adamw");
  refuse_if("--sequence-parallel", c.sequence_parallel && c.tensor_parallel == 1,
            "shards activations over the tensor-parallel ranks, and " +
                setting("--tensor-parallel", std::to_string(c.tensor_parallel)) +
                " has none to shard over; add --tensor-parallel K (K > 1, --model gpt), or drop it");
  refuse_if("--cluster", !c.plan, "is what --plan plans the layout for; add --plan, or drop it");
  refuse_if("--pipeline-schedule", c.pipeline_parallel == 1,
            "orders the micro-batches of pipeline stages, and " +
                setting("--pipeline-parallel", std::to_string(c.pipeline_parallel)) +
                " has none; add --pipeline-parallel P (P > 1), or drop it");
  refuse_if("--virtual-pipeline-stages", c.virtual_pipeline_stages > 1 && c.pipeline_parallel == 1,
            "splits each pipeline stage into chunks, and " +
                setting("--pipeline-parallel", std::to_string(c.pipeline_parallel)) +
                " has none; add --pipeline-parallel P (P > 1), or drop it");
  refuse_if("--async-save", c.ckpt_format == "gathered" && c.async_save,
            "writes sharded checkpoints in the background, and --ckpt-format gathered is written by rank 0 while "
            "every rank waits; use --ckpt-format sharded, or drop --async-save");
  refuse_if("--zero-prefetch", c.zero < 2,
            "gathers ZeRO-2/3 units ahead, and " + setting("--zero", std::to_string(c.zero)) +
                " has none; add --zero 2 or 3, or drop it");
  refuse_if("--bucket-size-mb", c.zero >= 2,
            "sizes the gradient buckets, and --zero " + std::to_string(c.zero) +
                " reduces one unit (a block, an embedding, a layer) at a time; drop it");
  refuse_if("--min-lr", c.lr_decay_style == "constant",
            "where the cosine decay ends, and --lr-decay-style constant keeps --lr after the warm-up; use "
            "--lr-decay-style cosine, or drop it");
  for (const char* flag : {"--sample-prompt", "--sample-tokens", "--sample-temperature", "--sample-top-k"})
    refuse_if(flag, c.sample_interval == 0,
              "shapes the samples printed during training, and no --sample-interval is given; add "
              "--sample-interval N, or drop it");
  refuse_if("--sample-interval", c.sample_interval > 0 && !language_model,
            "prints text a language model generates, and " + setting("--model", model_text(c)) + " does not generate text; drop it");
  for (const char* flag : {"--eval-interval", "--eval-iters"})
    refuse_if(flag, c.eval_data.empty(),
              "evaluation needs held-out data, and no --eval-data is given; add --eval-data FILE, or drop it");

  if (problems.empty()) return;
  std::string text = problems.size() == 1 ? "this setting was given, but this run would not use it:"
                                          : "these settings were given, but this run would not use them:";
  for (const std::string& problem : problems) text += "\n  " + problem;
  TESSERA_THROW(text);
}

void validate(const TrainConfig& c) {
  // A number too large for its type (a float 1e39, a double 1e400) reads as inf; set in code, anything may be.
  for (const auto& [flag, value] :
       std::initializer_list<std::pair<const char*, double>>{{"--lr", c.lr},
                                                             {"--min-lr", c.min_lr},
                                                             {"--weight-decay", c.weight_decay},
                                                             {"--adam-beta1", c.adam_beta1},
                                                             {"--adam-beta2", c.adam_beta2},
                                                             {"--adam-eps", c.adam_eps},
                                                             {"--sgd-momentum", c.sgd_momentum},
                                                             {"--clip-grad", c.clip_grad},
                                                             {"--hidden-dropout", c.hidden_dropout},
                                                             {"--attention-dropout", c.attention_dropout},
                                                             {"--epochs", c.epochs},
                                                             {"--bucket-size-mb", c.bucket_size_mb},
                                                             {"--comm-timeout", c.comm_timeout}})
    TESSERA_CHECK(std::isfinite(value), flag, " must be a finite number, got ", value);
  TESSERA_CHECK(c.comm_timeout >= 0 && c.comm_timeout <= kMaxTimeoutSeconds,
                "--comm-timeout must be a number of seconds from 0 (no limit) to 31536000 (a year), got ",
                c.comm_timeout);
  TESSERA_CHECK(std::isfinite(c.straggler_threshold) && c.straggler_threshold >= 0,
                "--straggler-threshold must be 0 (off) or a positive fraction, got ", c.straggler_threshold);
  if (!c.metrics_push.empty()) io::parse_http_url(c.metrics_push, "--metrics-push", "http://pushgateway:9091");
  if (!c.mlflow_uri.empty()) io::parse_http_url(c.mlflow_uri, "--mlflow-uri", "http://mlflow:5000", true);
  TESSERA_CHECK(std::isfinite(c.mlflow_timeout) && c.mlflow_timeout > 0, "--mlflow-timeout must be a positive number "
                "of seconds, got ", c.mlflow_timeout);
  TESSERA_CHECK(!c.mlflow_uri.empty() || (c.mlflow_experiment.empty() && c.mlflow_run_name.empty()),
                "--mlflow-experiment and --mlflow-run-name name the run of --mlflow-uri; give the tracking server's "
                "URL too, e.g. --mlflow-uri http://mlflow:5000");
  TESSERA_CHECK(c.sample_interval >= 0 && c.sample_tokens > 0 && c.sample_top_k >= 0,
                "--sample-interval and --sample-top-k must not be negative and --sample-tokens must be positive");
  TESSERA_CHECK(std::isfinite(c.sample_temperature) && c.sample_temperature >= 0.0f,
                "--sample-temperature must be 0 (greedy) or positive, got ", c.sample_temperature);
  TESSERA_CHECK(c.sample_interval == 0 || c.pipeline_parallel == 1,
                "--sample-interval: samples need the whole model on each tensor-parallel group, and "
                "--pipeline-parallel ",
                c.pipeline_parallel, " splits it; sample the checkpoint afterwards with `tessera generate`");
  TESSERA_CHECK(c.sample_interval == 0 || !c.sequence_parallel,
                "--sample-interval: samples generate one token at a time, which --sequence-parallel cannot split; "
                "drop one of them (and sample the checkpoint with `tessera generate`)");
  TESSERA_CHECK(c.synthetic || !c.data.empty(),
                "no training data: give --data FILE (made by `tessera prepare`) or --synthetic");
  TESSERA_CHECK(!(c.synthetic && !c.data.empty()), "--synthetic and --data exclude each other; pick one");
  for (const std::string* path : {&c.data, &c.eval_data})
    TESSERA_CHECK(path->empty() || std::filesystem::exists(*path), "data file ", *path,
                  " does not exist; make it with `tessera prepare idx|text ... -o ", *path, "`");
  TESSERA_CHECK(c.micro_batch_size > 0, "--micro-batch-size must be positive, got ", c.micro_batch_size);
  TESSERA_CHECK(c.global_batch_size >= 0 && c.global_batch_size % c.micro_batch_size == 0, "--global-batch-size ",
                c.global_batch_size, " is not a multiple of --micro-batch-size ", c.micro_batch_size);
  // --init-from with no steps: the weights saved as a step-0 checkpoint (e.g. to generate from imported weights).
  const bool only_save_initial_weights = c.train_steps == 0 && c.epochs == 0 && !c.init_from.empty();
  TESSERA_CHECK(only_save_initial_weights || (c.train_steps > 0) != (c.epochs > 0),
                "give exactly one of --train-steps N and --epochs E (both positive); got --train-steps ", c.train_steps,
                " and --epochs ", c.epochs);
  TESSERA_CHECK(!only_save_initial_weights || !c.save.empty(),
                "--init-from with --train-steps 0 trains nothing: it saves the weights as a checkpoint at step 0, "
                "so it needs --save DIR (or give --train-steps N to train)");
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
  TESSERA_CHECK(c.vocab_size >= 0, "--vocab-size must not be negative (0, the default: the dataset's), got ",
                c.vocab_size);
  TESSERA_CHECK(c.make_vocab_size_divisible_by >= 1 && c.make_vocab_size_divisible_by <= 1 << 20,
                "--make-vocab-size-divisible-by must be from 1 to 1048576, got ", c.make_vocab_size_divisible_by);
  TESSERA_CHECK(c.zero >= 0 && c.zero <= 3, "--zero must be 0, 1, 2 or 3, got ", c.zero);
  TESSERA_CHECK(c.zero_prefetch >= 0, "--zero-prefetch must not be negative, got ", c.zero_prefetch);
  TESSERA_CHECK(c.tensor_parallel >= 1, "--tensor-parallel must be at least 1, got ", c.tensor_parallel);
  TESSERA_CHECK(c.pipeline_parallel >= 1, "--pipeline-parallel must be at least 1, got ", c.pipeline_parallel);
  const nn::ModelTraits& model = nn::model_traits(c.model);
  TESSERA_CHECK(c.pipeline_parallel == 1 || model.splits_into_stages, "--pipeline-parallel ", c.pipeline_parallel,
                " splits the layers of --model gpt or mlp; --model ", c.model, " trains with --pipeline-parallel 1");
  TESSERA_CHECK(c.pipeline_schedule != "zbv" || c.virtual_pipeline_stages <= 2, "--pipeline-schedule zbv runs two ",
                "chunks per stage in a V; use --virtual-pipeline-stages 2 (or leave it out), not ",
                c.virtual_pipeline_stages);
  TESSERA_CHECK(c.virtual_pipeline_stages == 1 || c.pipeline_schedule == "1f1b" || c.pipeline_schedule == "zbv",
                "--virtual-pipeline-stages ", c.virtual_pipeline_stages,
                " interleaves the 1F1B schedule; use --pipeline-schedule 1f1b (the default)");
  parallel::parse_pipeline_schedule(c.pipeline_schedule);  // names the schedules this build knows otherwise
  TESSERA_CHECK(c.pipeline_split.empty() || c.pipeline_parallel > 1, "--pipeline-split '", c.pipeline_split,
                "' needs --pipeline-parallel > 1");
  TESSERA_CHECK(c.tensor_parallel == 1 || model.splits_over_tensor_parallel, "--tensor-parallel ", c.tensor_parallel,
                " splits the layers of --model gpt; --model ", c.model,
                " trains with data parallelism only (drop --tensor-parallel)");
  TESSERA_CHECK(c.context_parallel == 1 || model.reads_tokens, "--context-parallel-size ", c.context_parallel,
                " splits the sequences of --model gpt or llama; --model ", c.model,
                " has none (drop --context-parallel-size)");
  TESSERA_CHECK(c.context_parallel == 1 || c.seq_length % (2 * c.context_parallel) == 0, "--context-parallel-size ",
                c.context_parallel, " cuts each sequence into ", 2 * c.context_parallel,
                " equal chunks; --seq-length ", c.seq_length, " is not a multiple of ", 2 * c.context_parallel);
  if (c.expert_parallel > 1) {
    const int64_t experts = experts_of(c);
    TESSERA_CHECK(experts > 0 && experts % c.expert_parallel == 0, "--expert-model-parallel-size ", c.expert_parallel,
                  " splits the experts over ", c.expert_parallel, " ranks; --num-experts ", experts,
                  " is not a multiple of it (each rank holds the same number)");
  }
  TESSERA_CHECK(c.context_parallel == 1 || c.sample_interval == 0, "--context-parallel-size ", c.context_parallel,
                " does not sample during training yet; drop --sample-interval (the checkpoints generate without "
                "context parallelism: tessera generate)");
  TESSERA_CHECK(c.bucket_size_mb > 0, "--bucket-size-mb must be positive, got ", c.bucket_size_mb);
  TESSERA_CHECK(c.comm_backend == "auto" || c.comm_backend == "mpi" || c.comm_backend == "nccl",
                "--comm-backend must be auto, mpi or nccl, got '", c.comm_backend, "'");
  TESSERA_CHECK(c.hidden_dropout >= 0 && c.hidden_dropout < 1, "--hidden-dropout must be in [0, 1), got ",
                c.hidden_dropout);
  TESSERA_CHECK(c.attention_dropout >= 0 && c.attention_dropout < 1, "--attention-dropout must be in [0, 1), got ",
                c.attention_dropout);
  TESSERA_CHECK(c.save_interval >= 0, "--save-interval must not be negative (0: save only at the end and on a ",
                "signal), got ", c.save_interval);
  TESSERA_CHECK(c.keep_checkpoints >= 0, "--keep-checkpoints must not be negative (0: keep all), got ",
                c.keep_checkpoints);
  TESSERA_CHECK(c.exit_interval >= 0, "--exit-interval must not be negative (0: off), got ", c.exit_interval);
  TESSERA_CHECK(std::isfinite(c.save_interval_minutes) && c.save_interval_minutes >= 0 &&
                    c.save_interval_minutes <= kMaxTimeoutSeconds / 60.0,
                "--save-interval-minutes must be a number of minutes from 0 (off) to 525600 (a year), got ",
                c.save_interval_minutes);
  TESSERA_CHECK(!c.save.empty() || (c.save_interval == 0 && c.save_interval_minutes == 0 && c.keep_checkpoints == 0),
                "--save-interval, --save-interval-minutes and --keep-checkpoints need --save DIR (where checkpoints "
                "go)");
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
  const nn::ModelKind kind = c.model;
  if (kind == nn::ModelKind::mlp) out << " hidden=" << list(c.hidden);
  if (nn::model_traits(kind).reads_tokens) {  // the decoder's switches in force
    const nn::DecoderChoices d = nn::decoder_defaults(kind);
    const bool rope = c.position_embedding_type.empty() ? d.rotary : c.position_embedding_type == "rope";
    out << " normalization=" << (c.normalization.empty() ? nn::normalization_name(d.normalization) : c.normalization)
        << " position_embedding_type=" << (rope ? "rope" : "learned_absolute") << " swiglu=" << (c.swiglu || d.swiglu)
        << " bias=" << (d.bias && !c.disable_bias_linear)
        << " num_query_groups=" << (c.group_query_attention ? c.num_query_groups : c.num_heads)
        << " untie_embeddings_and_output_weights=" << (c.untie_embeddings || d.untie_embeddings);
    if (rope) out << " rotary_base=" << c.rotary_base;
    if (c.num_experts > 0)
      out << " num_experts=" << c.num_experts << " moe_router_topk=" << c.moe_router_topk
          << " moe_layer_freq=" << c.moe_layer_freq << " moe_ffn_hidden_size=" << c.moe_ffn_hidden_size
          << " moe_aux_loss_coeff=" << c.moe_aux_loss_coeff << " moe_z_loss_coeff=" << c.moe_z_loss_coeff
          << " moe_expert_capacity_factor=" << c.moe_expert_capacity_factor;
  }
  if (nn::model_traits(kind).reads_tokens)
    out << " vocab_size=" << (c.vocab_size ? std::to_string(c.vocab_size) : "auto") << " seq_length=" << c.seq_length
        << " num_layers=" << c.num_layers << " num_heads=" << c.num_heads << " hidden_size=" << c.hidden_size
        << " ffn_hidden_size=" << c.ffn_hidden_size << " hidden_dropout=" << c.hidden_dropout
        << " attention_dropout=" << c.attention_dropout << " recompute=" << c.recompute;
  out << "\ndata=" << (c.synthetic ? "synthetic" : c.data) << " eval_data=" << c.eval_data
      << "\nmicro_batch_size=" << c.micro_batch_size << " global_batch_size=" << c.global_batch_size
      << " train_steps=" << c.train_steps << " epochs=" << c.epochs << "\noptimizer=" << c.optimizer << " lr=" << c.lr
      << " min_lr=" << c.min_lr << " warmup_steps=" << c.warmup_steps << " lr_decay_style=" << c.lr_decay_style
      << " weight_decay=" << c.weight_decay << " clip_grad=" << c.clip_grad << "\nprecision=" << c.precision
      << " device=" << c.device << " threads=" << c.threads << " seed=" << c.seed
      << "\ntensor_parallel=" << c.tensor_parallel << " sequence_parallel=" << c.sequence_parallel
      << " context_parallel=" << c.context_parallel << " expert_parallel=" << c.expert_parallel
      << " pipeline_parallel=" << c.pipeline_parallel << " rank_order=" << c.rank_order
      << " pipeline_schedule=" << c.pipeline_schedule
      << " pipeline_split=" << c.pipeline_split << " virtual_pipeline_stages=" << c.virtual_pipeline_stages
      << " zero=" << c.zero << " zero_prefetch=" << c.zero_prefetch
      << " bucket_size_mb=" << c.bucket_size_mb << " comm_backend=" << c.comm_backend
      << " comm_timeout=" << c.comm_timeout << "\neval_interval=" << c.eval_interval << " eval_iters=" << c.eval_iters
      << " metrics=" << c.metrics << " trace=" << c.trace << " katib_metrics=" << c.katib_metrics
      << " metrics_port=" << c.metrics_port << " metrics_push=" << c.metrics_push
      << " straggler_threshold=" << c.straggler_threshold << " mlflow_uri=" << c.mlflow_uri
      << " mlflow_experiment=" << c.mlflow_experiment << " mlflow_run_name=" << c.mlflow_run_name;
  if (!c.save.empty() || !c.resume.empty())
    out << "\nsave=" << c.save << " save_interval=" << c.save_interval
        << " save_interval_minutes=" << c.save_interval_minutes << " save_timeout=" << c.save_timeout
        << " keep_checkpoints=" << c.keep_checkpoints << " resume=" << c.resume << " exit_interval=" << c.exit_interval;
  if (!c.init_from.empty()) out << "\ninit_from=" << c.init_from;
  if (c.sample_interval > 0)
    out << "\nsample_interval=" << c.sample_interval << " sample_tokens=" << c.sample_tokens
        << " sample_temperature=" << c.sample_temperature << " sample_top_k=" << c.sample_top_k;
  return out.str();
}

namespace {

// The shortest text that reads back as the same float or double.
template <typename Float>
std::string exact(Float value) {
  return shortest_text(value);
}

}  // namespace

std::vector<std::pair<std::string, std::string>> settings(const TrainConfig& c) {
  std::string hidden;
  for (size_t i = 0; i < c.hidden.size(); ++i) hidden += (i ? "," : "") + std::to_string(c.hidden[i]);
  const auto flag = [](bool value) { return std::string(value ? "true" : "false"); };
  return {
      {"model", model_text(c)},
      {"hidden", hidden},
      {"vocab-size", std::to_string(c.vocab_size)},
      {"make-vocab-size-divisible-by", std::to_string(c.make_vocab_size_divisible_by)},
      {"seq-length", std::to_string(c.seq_length)},
      {"num-layers", std::to_string(c.num_layers)},
      {"num-heads", std::to_string(c.num_heads)},
      {"hidden-size", std::to_string(c.hidden_size)},
      {"ffn-hidden-size", std::to_string(c.ffn_hidden_size)},
      {"hidden-dropout", exact(c.hidden_dropout)},
      {"attention-dropout", exact(c.attention_dropout)},
      {"recompute", flag(c.recompute)},
      {"normalization", c.normalization},
      {"norm-epsilon", exact(c.norm_epsilon)},
      {"position-embedding-type", c.position_embedding_type},
      {"rotary-base", exact(c.rotary_base)},
      {"swiglu", flag(c.swiglu)},
      {"group-query-attention", flag(c.group_query_attention)},
      {"num-query-groups", std::to_string(c.num_query_groups)},
      {"disable-bias-linear", flag(c.disable_bias_linear)},
      {"untie-embeddings-and-output-weights", flag(c.untie_embeddings)},
      {"num-experts", std::to_string(c.num_experts)},
      {"moe-router-topk", std::to_string(c.moe_router_topk)},
      {"moe-layer-freq", c.moe_layer_freq},
      {"moe-ffn-hidden-size", std::to_string(c.moe_ffn_hidden_size)},
      {"moe-aux-loss-coeff", exact(c.moe_aux_loss_coeff)},
      {"moe-z-loss-coeff", exact(c.moe_z_loss_coeff)},
      {"moe-expert-capacity-factor", exact(c.moe_expert_capacity_factor)},
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
      {"context-parallel-size", std::to_string(c.context_parallel)},
      {"expert-model-parallel-size", std::to_string(c.expert_parallel)},
      {"pipeline-parallel", std::to_string(c.pipeline_parallel)},
      {"rank-order", c.rank_order},
      {"pipeline-schedule", c.pipeline_schedule},
      {"pipeline-split", c.pipeline_split},
      {"virtual-pipeline-stages", std::to_string(c.virtual_pipeline_stages)},
      {"zero", std::to_string(c.zero)},
      {"zero-prefetch", std::to_string(c.zero_prefetch)},
      {"estimate-memory", flag(c.estimate_memory)},
      {"plan", flag(c.plan)},
      {"cluster", c.cluster},
      {"bucket-size-mb", exact(c.bucket_size_mb)},
      {"comm-backend", c.comm_backend},
      {"comm-timeout", exact(c.comm_timeout)},
      {"eval-interval", std::to_string(c.eval_interval)},
      {"eval-iters", std::to_string(c.eval_iters)},
      {"log-interval", std::to_string(c.log_interval)},
      {"metrics", c.metrics},
      {"katib-metrics", flag(c.katib_metrics)},
      {"metrics-port", std::to_string(c.metrics_port)},
      {"metrics-push", c.metrics_push},
      {"straggler-threshold", exact(c.straggler_threshold)},
      {"mlflow-uri", c.mlflow_uri},
      {"mlflow-experiment", c.mlflow_experiment},
      {"mlflow-run-name", c.mlflow_run_name},
      {"mlflow-timeout", exact(c.mlflow_timeout)},
      {"trace", c.trace},
      {"config", c.config_file},
      {"save", c.save},
      {"save-interval", std::to_string(c.save_interval)},
      {"save-interval-minutes", exact(c.save_interval_minutes)},
      {"keep-checkpoints", std::to_string(c.keep_checkpoints)},
      {"ckpt-format", c.ckpt_format},
      {"async-save", flag(c.async_save)},
      {"save-timeout", exact(c.save_timeout)},
      {"resume", c.resume},
      {"exit-interval", std::to_string(c.exit_interval)},
      {"init-from", c.init_from},
      {"sample-interval", std::to_string(c.sample_interval)},
      {"sample-prompt", c.sample_prompt},
      {"sample-tokens", std::to_string(c.sample_tokens)},
      {"sample-temperature", exact(c.sample_temperature)},
      {"sample-top-k", std::to_string(c.sample_top_k)},
  };
}

}  // namespace tessera::app
