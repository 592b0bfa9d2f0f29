// The `plan` subcommand: the model from `tessera train`'s flags, the cluster
// from --cluster, the search or one layout's breakdown printed.
#include "apps/plan_command.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <set>
#include <string>

#include "apps/cluster_file.h"
#include "apps/train_config.h"
#include "apps/trainer.h"
#include "core/error.h"
#include "parallel/memory_plan.h"
#include "plan/report.h"

namespace tessera::app {
namespace {

struct PlanOptions {
  TrainConfig train;
  bool explain = false;
  int top = 10;
};

bool given(const TrainConfig& c, const std::string& flag) {
  return c.given.count(flag) > 0;
}

// Flags of `tessera train` that change nothing a plan predicts (data, steps,
// learning rate, output, checkpoints) are refused, each by name.
void refuse_training_only_flags(const CLI::App& command) {
  const std::set<std::string> groups = {"Model", "Mixture of experts (gpt, llama)"};
  const std::set<std::string> flags = {
      "--micro-batch-size", "--global-batch-size", "--optimizer", "--sgd-momentum", "--precision",
      "--cluster",          "--explain",           "--top",       "--config"};
  for (const CLI::Option* option : command.get_options()) {
    if (option->count() == 0) continue;
    if (option->get_name() == "--plan") TESSERA_THROW("--plan is `tessera train`'s: `tessera plan` plans already");
    const std::string& group = option->get_group();
    if (groups.count(group) > 0 || group.rfind("Parallelism", 0) == 0 || flags.count(option->get_name()) > 0) continue;
    TESSERA_THROW(option->get_name(),
                  " does not change what `tessera plan` predicts (it plans the model, batch, "
                  "precision and layout flags of `tessera train`); leave it out");
  }
}

plan::PlanModel plan_model(const TrainConfig& c) {
  TESSERA_CHECK(given(c, "--vocab-size") && c.vocab_size > 0,
                "tessera plan needs --vocab-size (a prepared dataset's vocabulary padded, e.g. 50304 or 128256)");
  TESSERA_CHECK(c.global_batch_size > 0, "tessera plan needs --global-batch-size (sequences per optimizer step)");
  plan::PlanModel pm;
  pm.model = model_of(c);
  pm.model.validate();
  pm.global_batch = c.global_batch_size;
  pm.dtype = dtype_of(c);
  pm.optimizer = optimizer_of(c);
  return pm;
}

// The layout flags given fix their axes; the rest are searched.
plan::SearchLimits limits_from(const TrainConfig& c) {
  plan::SearchLimits lim;
  if (given(c, "--tensor-parallel")) lim.tp = c.tensor_parallel;
  if (given(c, "--pipeline-parallel")) lim.pp = c.pipeline_parallel;
  if (given(c, "--context-parallel-size")) lim.cp = c.context_parallel;
  if (given(c, "--expert-model-parallel-size")) lim.ep = c.expert_parallel;
  if (given(c, "--zero")) lim.zero = c.zero;
  if (given(c, "--micro-batch-size")) lim.micro_batch = c.micro_batch_size;
  if (given(c, "--virtual-pipeline-stages")) lim.vpp = c.virtual_pipeline_stages;
  if (given(c, "--pipeline-schedule")) lim.schedule = parallel::parse_pipeline_schedule(c.pipeline_schedule);
  if (given(c, "--recompute")) lim.recompute = c.recompute;
  if (given(c, "--sequence-parallel")) lim.sequence_parallel = c.sequence_parallel;
  return lim;
}

// --cluster local: the file `tessera selfcheck --cluster` wrote for this allocation.
std::string local_cluster_file() {
  const char* named = std::getenv("TESSERA_CLUSTER_FILE");
  const std::string path = named != nullptr && *named != '\0' ? named : "tessera-cluster.toml";
  TESSERA_CHECK(std::filesystem::is_regular_file(path), "--cluster local: no ", path,
                " (measure this allocation first: mpirun -np N tessera selfcheck --cluster, which writes it), or give "
                "--cluster SPEC (e.g. 8xH100-SXM:NVLink4,IB-NDR400x8:nodes=64) or a TOML file");
  return path;
}

plan::Cluster cluster_from(const std::string& text) {
  TESSERA_CHECK(!text.empty(),
                "--cluster is empty: give a SPEC (e.g. 8xH100-SXM:NVLink4,IB-NDR400x8:nodes=64), a "
                "TOML file, or local");
  if (text == "local") return read_cluster_file(local_cluster_file());
  return names_cluster_file(text) ? read_cluster_file(text) : plan::parse_cluster(text);
}

int run_plan(const CLI::App& command, PlanOptions& o) {
  record_given_flags(command, o.train);
  refuse_training_only_flags(command);
  const plan::PlanModel pm = plan_model(o.train);
  const plan::Cluster cluster = cluster_from(o.train.cluster);
  std::printf("cluster: %s\n", cluster.describe().c_str());
  std::printf("model: %s, %lld layers, hidden %lld, %lld heads, seq %lld, vocabulary %lld; global batch %lld; %s\n",
              std::string(nn::model_name(pm.model.kind)).c_str(), static_cast<long long>(pm.model.num_layers),
              static_cast<long long>(pm.model.hidden_size), static_cast<long long>(pm.model.num_heads),
              static_cast<long long>(pm.model.seq_length), static_cast<long long>(pm.model.vocab_size),
              static_cast<long long>(pm.global_batch), o.train.precision.c_str());
  // Large worlds have hundreds of thousands of layouts: say how far the search is (on a terminal).
  const bool terminal = ::isatty(STDERR_FILENO) != 0;
  const auto progress = [terminal](int64_t done, int64_t total) {
    if (terminal && total > 20000)
      std::fprintf(stderr, "\rplan: %lld of %lld layouts predicted", static_cast<long long>(done),
                   static_cast<long long>(total));
  };
  const plan::SearchResult found = plan::search_layouts(pm, cluster, limits_from(o.train), 24, progress);
  if (terminal && found.considered > 20000) std::fprintf(stderr, "\r%60s\r", "");
  std::printf("layouts: %lld considered, %lld refused, %lld do not fit, %zu fit\n",
              static_cast<long long>(found.considered), static_cast<long long>(found.refused),
              static_cast<long long>(found.too_big), found.ranked.size());
  if (found.ranked.empty()) {
    std::fprintf(stderr, "tessera plan: no layout fits %s\n", cluster.describe().c_str());
    if (found.smallest)
      std::fprintf(stderr,
                   "the nearest: %s needs %s per rank; add accelerators, raise --tp/--pp or --zero, or "
                   "give --recompute\n",
                   found.smallest->layout.describe().c_str(),
                   parallel::byte_text(found.smallest->memory.total()).c_str());
    for (const std::string& why : found.refusals) std::fprintf(stderr, "refused: %s\n", why.c_str());
    return 1;
  }
  const plan::Prediction& best = found.ranked.front();
  if (o.explain)
    std::printf("%s", plan::explain(best, cluster).c_str());
  else
    std::printf("%s", plan::ranking_table(found, size_t(o.top)).c_str());
  std::printf("%s", plan::name_values(best).c_str());
  return 0;
}

plan::PlanLayout best_layout(const TrainConfig& c, int world_size) {
  const plan::PlanModel pm = plan_model(c);
  const plan::Cluster cluster = cluster_from(c.cluster);
  TESSERA_CHECK(cluster.world() == world_size, "--plan: --cluster ", c.cluster, " has ", cluster.world(),
                " accelerators but this job has ", world_size,
                " ranks; give the cluster of this job (or run `tessera selfcheck --cluster` on it)");
  const plan::SearchResult found = plan::search_layouts(pm, cluster, limits_from(c));
  TESSERA_CHECK(!found.ranked.empty(), "--plan: no layout of ", world_size, " ranks fits ", cluster.describe(),
                found.smallest ? "; the nearest, " + found.smallest->layout.describe() + ", needs " +
                                     parallel::byte_text(found.smallest->memory.total()) + " per rank"
                               : std::string());
  return found.ranked.front().layout;
}

}  // namespace

TrainConfig with_planned_layout(const TrainConfig& c, int world_size, std::string& chosen) {
  const plan::PlanLayout l = best_layout(c, world_size);
  TrainConfig planned = c;
  planned.tensor_parallel = l.tp;
  planned.pipeline_parallel = l.pp;
  planned.context_parallel = l.cp;
  planned.expert_parallel = l.ep;
  planned.zero = l.zero;
  planned.micro_batch_size = l.micro_batch;
  planned.recompute = l.recompute;
  planned.sequence_parallel = l.sequence_parallel;
  planned.pipeline_schedule = std::string(parallel::pipeline_schedule_name(l.schedule));
  planned.virtual_pipeline_stages = l.schedule == parallel::PipelineScheduleKind::zbv ? 1 : l.vpp;
  chosen = l.describe() + " (" + l.flags() + ")";
  return planned;
}

void register_plan_command(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<PlanOptions>();
  auto* plan_cmd = app.add_subcommand(
      "plan", "Predict step time, memory and MFU of every layout of a model on a cluster, fastest first");
  add_train_options(*plan_cmd, options->train);
  const std::string group = "Plan";
  plan_cmd->add_flag("--explain", options->explain, "Print where the best layout's step time and memory go")
      ->group(group);
  plan_cmd->add_option("--top", options->top, "Layouts in the table")->check(CLI::Range(1, 1000))->group(group);
  plan_cmd->callback([plan_cmd, options, &exit_code] {
    apply_config_file(*plan_cmd, options->train);
    exit_code = run_plan(*plan_cmd, *options);
  });
}

}  // namespace tessera::app
