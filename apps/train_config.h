// TrainConfig: everything `tessera train` is told, from flags and a TOML file
// (`--config FILE`; flags given on the command line win). Flag names follow
// Megatron-LM where it has one (--micro-batch-size, --global-batch-size, --lr,
// --min-lr, --weight-decay, --clip-grad, --eval-interval, --seed, --num-layers,
// --hidden-size, ...). Parsed in one place, validated with messages that name
// the flag (a setting given but unused is refused too; an unknown flag gets
// the one meant), and echoed by rank 0.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "nn/model_kind.h"

namespace tessera::app {

struct TrainConfig {
  // Model.
  nn::ModelKind model = nn::ModelKind::mlp;   // --model mlp|cnn|gpt|llama (parsed once, here)
  std::vector<int64_t> hidden = {1024, 1024};  // --hidden (mlp)
  int64_t vocab_size = 0;                      // gpt; 0: the dataset's, padded (256 with --synthetic)
  int64_t make_vocab_size_divisible_by = 128;  // gpt, --vocab-size 0: the dataset's vocabulary padded to a multiple
  int64_t seq_length = 256;
  int64_t num_layers = 4;
  int64_t num_heads = 4;
  int64_t hidden_size = 256;
  int64_t ffn_hidden_size = 0;  // 0: 4 × hidden size
  float hidden_dropout = 0.0f;
  float attention_dropout = 0.0f;  // --attention-dropout (gpt, llama): on the attention probabilities
  bool recompute = false;
  // The Llama family's choices, by Megatron's flag names. --model llama is
  // RMSNorm, rope, SwiGLU, no biases and an untied head; "" / false: the model's own.
  std::string normalization;            // --normalization LayerNorm|RMSNorm
  float norm_epsilon = 1e-5f;           // --norm-epsilon
  std::string position_embedding_type;  // --position-embedding-type learned_absolute|rope
  float rotary_base = 10000.0f;         // --rotary-base
  bool swiglu = false;                  // --swiglu
  bool group_query_attention = false;   // --group-query-attention
  int64_t num_query_groups = 0;         // --num-query-groups (with --group-query-attention)
  bool disable_bias_linear = false;     // --disable-bias-linear
  bool untie_embeddings = false;        // --untie-embeddings-and-output-weights
  // Mixture of experts (gpt, llama; Megatron's flags, parallel/moe.h): 0 experts: dense MLPs.
  int64_t num_experts = 0;                 // --num-experts E
  int64_t moe_router_topk = 2;             // --moe-router-topk K
  std::string moe_layer_freq = "1";        // --moe-layer-freq N or [1,0,1,1]
  int64_t moe_ffn_hidden_size = 0;         // --moe-ffn-hidden-size (0: --ffn-hidden-size's width)
  double moe_aux_loss_coeff = 0.0;         // --moe-aux-loss-coeff (Switch load balancing)
  double moe_z_loss_coeff = 0.0;           // --moe-z-loss-coeff (ST-MoE router z-loss)
  double moe_expert_capacity_factor = 0.0; // --moe-expert-capacity-factor (0: dropless)

  // Data.
  std::string data;        // prepared HDF5 file (tessera prepare ...)
  std::string eval_data;   // held-out file; evaluation is skipped without one
  bool synthetic = false;  // random inputs of the model's shapes (smoke runs, benchmarks)

  // Batches and length of training.
  int64_t micro_batch_size = 64;
  int64_t global_batch_size = 0;  // 0: one micro-batch per step; otherwise a multiple (gradient accumulation)
  int64_t train_steps = 0;        // one of --train-steps and --epochs
  double epochs = 0;

  // Optimizer and schedule.
  std::string optimizer = "adamw";  // adamw | sgd
  // Doubles, as Megatron-LM's arguments and PyTorch's optimizers hold them.
  double lr = 1e-3;
  double min_lr = 0.0;
  int64_t warmup_steps = 0;
  std::string lr_decay_style = "cosine";  // cosine | constant
  double weight_decay = 0.0;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_eps = 1e-8;
  float sgd_momentum = 0.9f;
  bool nesterov = false;
  float clip_grad = 1.0f;          // 0 disables clipping
  int64_t max_skipped_steps = 10;  // consecutive non-finite steps before the run stops

  // Precision and machine.
  std::string precision = "fp32";  // fp32 | bf16 | fp16
  std::string device = "cpu";      // cpu | cuda | cuda:N
  int threads = 0;                 // CPU threads; 0: OpenMP's default
  uint64_t seed = 1234;

  // Parallelism: world = dp × tp × pp; dp = world / (tp · pp).
  int tensor_parallel = 1;         // --tensor-parallel/--tp K: split each GPT layer over K ranks (Megatron-style)
  bool sequence_parallel = false;  // --sequence-parallel: shard norms/dropout along the sequence (tp > 1)
  int context_parallel = 1;        // --context-parallel-size/--cp C: each sequence split over C ranks (ring attention)
  int expert_parallel = 1;         // --expert-model-parallel-size/--ep P: the experts split over P data ranks
  int pipeline_parallel = 1;       // --pipeline-parallel/--pp P: consecutive layers on P stages
  std::string rank_order = "tp-cp-ep-dp-pp";  // --rank-order: the layout's axes, fastest-varying first
  std::string pipeline_schedule = "1f1b";  // --pipeline-schedule gpipe|1f1b|zb-h1|zbv
  std::string pipeline_split;              // --pipeline-split 0,5,9,12: stage boundaries (empty: balanced)
  int virtual_pipeline_stages = 1;         // --virtual-pipeline-stages V: model chunks per stage (interleaved 1F1B)
  int zero = 0;                            // --zero 0-3: optimizer state (1), + gradients (2), + parameters (3) sharded
  int zero_prefetch = 1;                   // --zero-prefetch: ZeRO-2/3 units gathered ahead / reductions in flight
  bool estimate_memory = false;            // --estimate-memory: print the per-rank model-state bytes, do not train
  bool plan = false;              // --plan: pick the layout axes not given by `tessera plan` (apps/plan_command.h)
  std::string cluster = "local";  // --cluster SPEC|FILE|local: what `tessera plan` and --plan plan for
  double bucket_size_mb = 25.0;            // --bucket-size-mb: gradient all-reduce bucket size (MiB of f32)
  std::string comm_backend = "auto";  // --comm-backend auto|mpi|nccl (auto: NCCL for CUDA devices when built, else MPI)
  double comm_timeout = 300.0;        // --comm-timeout: seconds any collective or transfer may take (0: no limit)
  double save_timeout = 3600.0;       // --save-timeout: seconds a checkpoint save may take (0: no limit)

  // Evaluation and output.
  int64_t eval_interval = 0;  // steps between evaluations; 0: at the end of every epoch and at the end
  int64_t eval_iters = 0;     // batches per evaluation; 0: the whole eval set
  int64_t log_interval = 10;  // steps between plain progress lines when stdout is not a terminal
  std::string metrics;        // JSON-lines metrics file
  bool katib_metrics = false;  // --katib-metrics: Katib `name=value` lines on stdout (also on when Katib collects it)
  int metrics_port = 0;        // --metrics-port P: rank 0 serves every rank's metrics at :P/metrics (Prometheus)
  std::string metrics_push;    // --metrics-push URL: rank 0 pushes them to a Prometheus Pushgateway
  double straggler_threshold = 0.2;  // --straggler-threshold: compute this much above the median names a straggler
  std::string mlflow_uri;            // --mlflow-uri URL: rank 0 records the run in this MLflow tracking server
  std::string mlflow_experiment;     // --mlflow-experiment NAME (default: $MLFLOW_EXPERIMENT_NAME, else Default)
  std::string mlflow_run_name;       // --mlflow-run-name NAME (default: the server picks one)
  double mlflow_timeout = 30.0;      // --mlflow-timeout S: how long the end of training waits for the server
  std::string trace;          // Chrome-trace/Perfetto timeline file
  std::string config_file;    // --config

  // Checkpoints (io/checkpoint.h; layout and contents in docs/checkpoints.md).
  std::string save;           // --save DIR: checkpoints go to DIR/step_XXXXXXXX/
  int64_t save_interval = 0;  // --save-interval N: every N steps; 0: only at the end and on a signal
  double save_interval_minutes = 0.0;  // --save-interval-minutes M: when M minutes passed since the last save
  int keep_checkpoints = 0;   // --keep-checkpoints K: keep the newest K (0: all)
  std::string ckpt_format = "sharded";  // --ckpt-format sharded (a file per rank) | gathered (rank 0)
  bool async_save = true;     // --async-save / --no-async-save: sharded saves written in the background
  std::string resume;         // --resume auto|PATH: auto = newest complete checkpoint in --save DIR, if any
  int64_t exit_interval = 0;  // --exit-interval N: save (with --save) and stop after a step divisible by N
  std::set<std::string> given;  // the flags given ("--hidden-size"), record_given_flags
  std::string init_from;      // --init-from FILE.safetensors or DIR: initial weights (exported; Hugging Face GPT-2 or Llama)

  // Samples during training (GPT; models/generation.h).
  int64_t sample_interval = 0;       // --sample-interval N: print a sample every N steps (0: never)
  std::string sample_prompt = "\n";  // --sample-prompt TEXT, encoded with --data's tokenizer
  int64_t sample_tokens = 64;        // --sample-tokens: tokens per sample
  float sample_temperature = 1.0f;   // --sample-temperature (0: greedy)
  int64_t sample_top_k = 0;          // --sample-top-k (0: every token)
};

// Adds every flag to the `train` subcommand, bound to `config`.
void add_train_options(CLI::App& command, TrainConfig& config);

// Where the settings of a --config file came from: flag name ("--lr") -> line.
using ConfigFileLines = std::map<std::string, int>;

// Applies the TOML file named by --config (if any) to the options the command
// line did not set, and returns the line of each setting it applied. The file
// is TOML, read by toml++; the keys of [table]s apply like top-level ones.
// Invalid TOML (an unterminated string or array, a key set twice), an unknown
// key (with the flag it probably meant), an array for a one-value flag or a
// bad value is a tessera::Error naming the file, the line and the key.
ConfigFileLines apply_config_file(CLI::App& command, TrainConfig& config);

// Refuses settings that were given (on the command line or in the --config
// file) but that this run would not use, each with the reason and the fix:
// GPT flags for the MLP or CNN (--hidden-size: the MLP's widths are --hidden),
// --hidden for the GPT or CNN, SGD flags with AdamW and AdamW flags with SGD,
// --sequence-parallel with --tensor-parallel 1, --pipeline-schedule with
// --pipeline-parallel 1, --min-lr with --lr-decay-style constant, and
// --eval-interval/--eval-iters without --eval-data. Defaults never count: only
// options CLI11 saw (a boolean flag only when true). `from_file` (what
// apply_config_file returned) lets the message name the file's line.
void refuse_unused_settings(const CLI::App& command, const TrainConfig& config, const ConfigFileLines& from_file = {});
// Notes in config.given the flags given (on the command line or in the
// --config file), e.g. to tell a model size asked for from a default.
void record_given_flags(const CLI::App& command, TrainConfig& config);

// What an argument `command` does not know ("--learning-rate", "-lr",
// "--train-step=3", or a --config key such as "learning_rate") was probably
// meant to be: a flag of `command` a typo away (edit distance, or a unique
// prefix), or Tessera's flag for a name from Megatron-LM, PyTorch, DeepSpeed,
// nanoGPT or Hugging Face (--learning-rate, --train-iters,
// --num-attention-heads, --bf16, ...).
struct FlagSuggestion {
  std::string flag;   // "--lr"; empty when nothing is close (a note may still say what to do)
  std::string value;  // the value that goes with it ("bf16" for --bf16: --precision bf16), or empty
  std::string note;   // why, or what to do instead; may be empty
  bool empty() const { return flag.empty() && note.empty(); }
};
FlagSuggestion suggest_flag(const CLI::App& command, const std::string& unknown);

// The suggestion as text for a command line ("did you mean `--precision bf16`? (...)"),
// or for a --config file when `as_key` ("did you mean `precision = bf16`? (...)"); "" when empty.
std::string suggestion_text(const FlagSuggestion& suggestion, bool as_key = false);

// The name among `names` closest to `typo` by edit distance (a swap of two
// neighbours counts once), if close enough to be a typo of it; "" otherwise.
std::string closest_name(const std::string& typo, const std::vector<std::string>& names);

// Checks values that no single flag's validator can (combinations,
// positivity); throws tessera::Error naming the flag and the fix.
void validate(const TrainConfig& config);

// "key=value" lines of every setting, for rank 0's start-up echo.
std::string describe(const TrainConfig& config);

// Every setting as (key, value text), keys being the flag names without the
// leading dashes (the TOML keys of --config): what a checkpoint records of the
// run that wrote it, one metadata key per setting. Floats are written so they
// read back exactly.
std::vector<std::pair<std::string, std::string>> settings(const TrainConfig& config);

}  // namespace tessera::app
