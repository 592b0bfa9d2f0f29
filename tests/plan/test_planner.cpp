// The planner's parts against formulas written here: --cluster SPECs and
// their errors, the α–β collectives and which link a group crosses, the
// step's FLOPs and parameters (against a model the registry builds), the
// ZeRO-0/1 model state, the pipeline's span under the real schedules with
// costs (1F1B and interleaved: (M·V + P − 1)(F + B)), the refusals with
// their reasons, the search's ranking, and the name=value lines parsed back.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>

#include "core/context.h"
#include "core/error.h"
#include "models/registry.h"
#include "parallel/memory_plan.h"
#include "parallel/pipeline_schedule.h"
#include "plan/costs.h"
#include "plan/planner.h"
#include "plan/report.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

std::string thrown(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(nothing thrown)";
}

TEST(PlanCluster, ParsesASpecWithNodesAndLinks) {
  const plan::Cluster c = plan::parse_cluster("8xH100-SXM:NVLink4,IB-NDR400x8:nodes=64");
  EXPECT_EQ(c.per_node, 8);
  EXPECT_EQ(c.nodes, 64);
  EXPECT_EQ(c.world(), 512);
  EXPECT_EQ(c.accelerator.name, "H100-SXM");
  EXPECT_DOUBLE_EQ(c.accelerator.peak_flops_16, 989e12);
  EXPECT_DOUBLE_EQ(c.intra.bandwidth, 450e9 * 0.8);  // NVLink4 per GPU per direction, a ring's share
  EXPECT_DOUBLE_EQ(c.inter.bandwidth, 50e9 * 0.9);   // 8 NDR NICs shared by 8 GPUs
  const plan::Cluster fewer = plan::parse_cluster("8xH100-SXM:NVLink4,IB-NDR400x2:nodes=4");
  EXPECT_DOUBLE_EQ(fewer.inter.bandwidth, 50e9 * 0.9 * 2 / 8);  // 2 NICs for 8 GPUs
  const plan::Cluster one = plan::parse_cluster("a100");
  EXPECT_EQ(one.world(), 1);
  EXPECT_EQ(one.accelerator.name, "A100-80GB");
  EXPECT_EQ(plan::parse_cluster("4xB200:nodes=2").intra.name, "NVLink5");  // the accelerator's own links
  EXPECT_GT(plan::parse_cluster("2xcpu:shm").accelerator.peak_flops_32, 0);
  EXPECT_EQ(plan::parse_cluster("8xA100-40GB:PCIe4,RoCE-200x4:nodes=2").inter.bandwidth, 200e9 / 8 * 0.9 * 4 / 8);
}

TEST(PlanCluster, RefusesWhatItDoesNotKnowSayingWhatItKnows) {
  EXPECT_NE(thrown([] { plan::parse_cluster("8xH1000"); }).find("unknown accelerator 'H1000'; built in: A100-40GB"),
            std::string::npos);
  EXPECT_NE(thrown([] { plan::parse_cluster("0xH100"); }).find("'0' is not a number of accelerators per node"),
            std::string::npos);
  EXPECT_NE(thrown([] { plan::parse_cluster("8xH100-SXM:NVLink9"); }).find("unknown link 'NVLink9'; known: NVLink3"),
            std::string::npos);
  EXPECT_NE(thrown([] { plan::parse_cluster("8xH100-SXM:nodes=0"); }).find("nodes='0'"), std::string::npos);
  EXPECT_NE(thrown([] { plan::parse_cluster("8xH100-SXM:gpus=3"); }).find("unknown setting 'gpus=3'"),
            std::string::npos);
  EXPECT_NE(thrown([] { plan::parse_cluster("8xH100-SXM:a,b,c"); }).find("INTRA or INTRA,INTER"), std::string::npos);
  EXPECT_NE(thrown([] { plan::parse_cluster(""); }).find("empty"), std::string::npos);
}

TEST(PlanCosts, RingCollectivesAndTheLinksGroupsCross) {
  std::mt19937_64 rng(make_rng()());
  const plan::Cluster c = plan::parse_cluster("8xH100-SXM:NVLink4,IB-NDR400x8:nodes=4");
  const double bytes = std::uniform_real_distribution<double>(1e6, 1e9)(rng);
  // tp 8 inside a node; dp over 4 nodes, one member per node (stride 8): its own NIC.
  const plan::GroupLink tp = plan::group_link(c, 8, 1), dp = plan::group_link(c, 4, 8);
  EXPECT_FALSE(tp.crosses_nodes);
  EXPECT_TRUE(dp.crosses_nodes);
  EXPECT_DOUBLE_EQ(dp.bandwidth, c.inter.bandwidth);
  // 32 ranks, 8 per node: the node's 8 NICs carry the ring's crossing (capped by NVLink).
  const plan::GroupLink all = plan::group_link(c, 32, 1);
  EXPECT_DOUBLE_EQ(all.bandwidth, std::min(c.intra.bandwidth, 8 * c.inter.bandwidth));
  // All-reduce: the ring, or the tree (2·B/β + 2·log₂ n·α) when that is less.
  EXPECT_DOUBLE_EQ(plan::all_reduce_seconds(tp, bytes),
                   std::min(2.0 * 7 / 8 * bytes / c.intra.bandwidth + 2.0 * 7 * c.intra.latency,
                            2.0 * bytes / c.intra.bandwidth + 2.0 * 3 * c.intra.latency));
  const plan::GroupLink wide = plan::group_link(c, 32, 1);
  EXPECT_DOUBLE_EQ(plan::all_reduce_seconds(wide, 1024.0), 2.0 * 1024 / wide.bandwidth + 2.0 * 5 * wide.latency);
  EXPECT_DOUBLE_EQ(plan::all_reduce_seconds(wide, 1e11),
                   2.0 * 31 / 32 * 1e11 / wide.bandwidth + 2.0 * 31 * wide.latency);
  EXPECT_DOUBLE_EQ(plan::reduce_scatter_seconds(dp, bytes), 3.0 / 4 * bytes / c.inter.bandwidth + 3 * c.inter.latency);
  EXPECT_DOUBLE_EQ(plan::all_reduce_seconds(plan::group_link(c, 1, 1), bytes), 0.0);
  // A GEMM: 2mnk FLOPs at peak × efficiency, stretched by whole waves of tiles.
  const plan::Accelerator& a = c.accelerator;
  const int64_t m = 128 * 12, n = 256 * 11, k = 8192;  // 132 tiles: exactly one wave, compute-bound
  const double rate = a.peak_flops_16 * a.gemm_efficiency;
  EXPECT_NEAR(plan::gemm_seconds(a, DType::bf16, m, n, k), 2.0 * m * n * k / rate + a.launch_seconds, 1e-12);
  // One more row of tiles: 143 tiles in two waves of 132 units.
  EXPECT_NEAR(plan::gemm_seconds(a, DType::bf16, m + 128, n, k),
              2.0 * (m + 128) * n * k * (2.0 * 132 / 143) / rate + a.launch_seconds, 1e-12);
}

nn::ModelConfig small_llama(std::mt19937_64& rng) {
  nn::ModelConfig m;
  m.kind = nn::ModelKind::llama;
  m.num_layers = std::uniform_int_distribution<int64_t>(2, 6)(rng);
  m.num_heads = 4;
  m.num_query_groups = 2;
  m.hidden_size = 32 * std::uniform_int_distribution<int64_t>(1, 3)(rng);
  m.vocab_size = 64 * std::uniform_int_distribution<int64_t>(1, 4)(rng);
  m.seq_length = 16 * std::uniform_int_distribution<int64_t>(1, 4)(rng);
  return m;
}

// FLOPs: per layer 2·(qkv + projection + SwiGLU) weights per token plus
// attention's 4·s·h, times 3 (forward, backward) or 4 with recompute; the
// head 2·V·h per token, times 3.
TEST(PlanModel, StepFlopsAndParametersOfALlama) {
  std::mt19937_64 rng(make_rng()());
  plan::PlanModel pm;
  pm.model = small_llama(rng);
  pm.global_batch = 8;
  const nn::ModelConfig& m = pm.model;
  const double h = double(m.hidden_size), dh = h / 4, f = double(m.ffn()), tokens = 8.0 * double(m.seq_length);
  const double weights = h * (4 + 2 * 2) * dh + h * h + 3 * f * h;
  const double layer = 2 * weights * tokens + 4 * tokens * double(m.seq_length) * h;
  const double head = 2 * tokens * h * double(m.vocab_size);
  EXPECT_DOUBLE_EQ(plan::step_flops(pm, false), 3 * double(m.num_layers) * layer + 3 * head);
  EXPECT_DOUBLE_EQ(plan::step_flops(pm, true), 4 * double(m.num_layers) * layer + 3 * head);
  // The parameters the planner counts (ZeRO 0, one rank, f32: 4 bytes each)
  // are the registry's built model's.
  Context ctx;
  const auto built = models::build_model(m, nn::ModelSpec{&ctx, Device::cpu(), DType::f32, 7});
  pm.dtype = DType::f32;
  const plan::Prediction p = plan::predict(pm, plan::parse_cluster("cpu"), plan::PlanLayout{});
  EXPECT_EQ(p.memory.parameters, 4 * nn::parameter_count(*built));
}

// ZeRO-0 and -1 over D ranks, b-byte values, AdamW's S bytes: values bP;
// gradients 4P (+ 4P/D); optimizer SP (/D).
TEST(PlanModel, ZeroZeroAndOneModelState) {
  std::mt19937_64 rng(make_rng()());
  plan::PlanModel pm;
  pm.model = small_llama(rng);
  pm.dtype = DType::bf16;
  const int d = 4;
  pm.global_batch = 4 * d;
  const plan::Cluster c = plan::parse_cluster(std::to_string(d) + "xcpu:shm");
  Context ctx;
  const int64_t params =
      nn::parameter_count(*models::build_model(pm.model, nn::ModelSpec{&ctx, Device::cpu(), DType::f32, 1}));
  const int64_t s = parallel::optimizer_bytes_per_element(pm.optimizer, DType::bf16);
  for (const int zero : {0, 1}) {
    plan::PlanLayout l;
    l.dp = d;
    l.zero = zero;
    const plan::Prediction p = plan::predict(pm, c, l);
    EXPECT_EQ(p.memory.parameters, 2 * params) << "zero " << zero;
    EXPECT_EQ(p.memory.gradients, 4 * params + (zero == 1 ? 4 * params / d : 0)) << "zero " << zero;
    EXPECT_EQ(p.memory.optimizer, zero == 1 ? s * params / d : s * params) << "zero " << zero;
  }
}

// With every chunk's F and B the same and free transfers, 1F1B's step is
// (M + P − 1)(F + B) and interleaved 1F1B's (M·V + P − 1)(F + B) for F and B
// per chunk: the bubble's closed forms, from the real schedules simulated
// with costs.
TEST(PlanPipeline, SimulatedSpansAreTheBubblesClosedForms) {
  std::mt19937_64 rng(make_rng()());
  std::uniform_real_distribution<double> cost(0.5, 3.0);
  for (const int p : {2, 4})
    for (const int v : {1, 2}) {
      const int m = p * std::uniform_int_distribution<int>(1, 4)(rng);
      const double f = cost(rng), b = cost(rng);
      parallel::PipelineCosts costs;
      costs.forward.assign(size_t(p * v), f);
      costs.backward.assign(size_t(p * v), b);
      std::vector<std::vector<parallel::PipeInstruction>> lists;
      for (int s = 0; s < p; ++s)
        lists.push_back(parallel::pipeline_schedule(parallel::PipelineScheduleKind::one_f_one_b, p, s, m, v));
      const parallel::PipelineSimulation sim =
          parallel::simulate_pipeline(lists, m, parallel::ChunkPlacement::loop, costs);
      ASSERT_TRUE(sim.completed) << sim.problem;
      EXPECT_NEAR(sim.span(), double(m * v + p - 1) * (f + b), 1e-9) << "P " << p << " V " << v << " M " << m;
    }
}

plan::PlanModel small_gpt() {
  plan::PlanModel pm;
  pm.model.kind = nn::ModelKind::gpt;
  pm.model.num_layers = 4;
  pm.model.num_heads = 4;
  pm.model.hidden_size = 64;
  pm.model.vocab_size = 256;
  pm.model.seq_length = 64;
  pm.global_batch = 8;
  return pm;
}

TEST(PlanLayouts, RefusalsSayWhatDoesNotDivide) {
  const plan::PlanModel pm = small_gpt();
  const plan::Cluster c = plan::parse_cluster("4xcpu:shm");
  const auto problem = [&](auto change) {
    plan::PlanLayout l;
    l.dp = 4;
    change(l);
    return plan::layout_problem(pm, c, l);
  };
  EXPECT_EQ(problem([](plan::PlanLayout&) {}), "");
  EXPECT_NE(problem([](plan::PlanLayout& l) { l.dp = 2; }).find("= 2 ranks, but the cluster has 4"), std::string::npos);
  EXPECT_NE(problem([](plan::PlanLayout& l) { l.dp = 1, l.tp = 3, l.pp = 1; }).find("ranks"), std::string::npos);
  plan::PlanModel odd = pm;
  odd.model.num_heads = 2;
  plan::PlanLayout tp4;
  tp4.tp = 4;
  EXPECT_NE(plan::layout_problem(odd, c, tp4).find("--num-heads 2 is not divisible by --tensor-parallel 4"),
            std::string::npos);
  EXPECT_NE(problem([](plan::PlanLayout& l) { l.micro_batch = 4; }).find("--global-batch-size 8 is not a multiple"),
            std::string::npos);
  EXPECT_NE(problem([](plan::PlanLayout& l) { l.dp = 1, l.pp = 4, l.vpp = 2; }).find("layers"), std::string::npos);
  EXPECT_NE(problem([](plan::PlanLayout& l) { l.ep = 2; }).find("--ep 2"), std::string::npos);
  EXPECT_EQ(problem([](plan::PlanLayout& l) { l.dp = 1, l.cp = 4; }), "");
  plan::PlanModel uneven = pm;
  uneven.model.seq_length = 60;
  plan::PlanLayout cp4;
  cp4.cp = 4;
  EXPECT_NE(plan::layout_problem(uneven, c, cp4).find("--seq-length 60 is not a multiple of 2 x cp"),
            std::string::npos);
  // Interleaving needs M a multiple of P: the schedule's own refusal.
  plan::PlanModel deeper = pm;
  deeper.model.num_layers = 8;
  deeper.global_batch = 6;
  plan::PlanLayout interleaved;
  interleaved.pp = 4;
  interleaved.vpp = 2;
  EXPECT_NE(plan::layout_problem(deeper, c, interleaved).find("multiple"), std::string::npos)
      << plan::layout_problem(deeper, c, interleaved);
  EXPECT_THROW(plan::predict(pm, c, plan::PlanLayout{}), Error);  // world 1 on 4 ranks
}

TEST(PlanSearch, RanksFittingLayoutsFastestFirstWithinTheLimits) {
  const plan::PlanModel pm = small_gpt();
  const plan::Cluster c = plan::parse_cluster("4xcpu:shm");
  plan::SearchLimits limits;
  const plan::SearchResult all = plan::search_layouts(pm, c, limits);
  ASSERT_FALSE(all.ranked.empty());
  EXPECT_GT(all.refused, 0);
  EXPECT_FALSE(all.refusals.empty());
  for (size_t i = 0; i < all.ranked.size(); ++i) {
    EXPECT_TRUE(all.ranked[i].fits);
    EXPECT_EQ(plan::layout_problem(pm, c, all.ranked[i].layout), "");
    if (i > 0 && all.ranked[i].simulated == all.ranked[i - 1].simulated) {
      EXPECT_LE(all.ranked[i - 1].time.step, all.ranked[i].time.step * (1 + 1e-3));
    }
  }
  limits.tp = 2;
  limits.zero = 1;
  for (const plan::Prediction& p : plan::search_layouts(pm, c, limits).ranked) {
    EXPECT_EQ(p.layout.tp, 2);
    EXPECT_EQ(p.layout.zero, 1);
  }
  // Nothing fits: a model far larger than a CPU rank's memory.
  plan::PlanModel huge = pm;
  huge.model.num_layers = 64;
  huge.model.hidden_size = 8192;
  huge.model.num_heads = 64;
  huge.model.vocab_size = 32000;
  const plan::SearchResult none = plan::search_layouts(huge, c, {});
  EXPECT_TRUE(none.ranked.empty());
  EXPECT_GT(none.too_big, 0);
  ASSERT_TRUE(none.smallest.has_value());
  EXPECT_GT(double(none.smallest->memory.total()), plan::kUsableMemory * double(c.accelerator.memory_bytes));
}

TEST(PlanReport, NameValueLinesParseBack) {
  const plan::PlanModel pm = small_gpt();
  const plan::Cluster c = plan::parse_cluster("4xcpu:shm");
  const plan::SearchResult found = plan::search_layouts(pm, c, {});
  ASSERT_FALSE(found.ranked.empty());
  const plan::Prediction& best = found.ranked.front();
  const std::map<std::string, std::string> values = plan::parse_name_values("noise line\n" + plan::name_values(best));
  ASSERT_EQ(values.size(), 8u);
  EXPECT_EQ(std::stoll(values.at("predicted_rank0_memory_bytes")), best.stages.front().total());
  EXPECT_NEAR(std::stod(values.at("predicted_step_s")), best.time.step, 1e-5 * best.time.step);
  EXPECT_NEAR(std::stod(values.at("predicted_tokens_per_s")), best.tokens_per_s, 1e-5 * best.tokens_per_s);
  EXPECT_NEAR(std::stod(values.at("predicted_tflops_per_gpu")), best.tflops_per_gpu, 1e-5 * best.tflops_per_gpu);
  EXPECT_NEAR(std::stod(values.at("predicted_mfu")), best.mfu, 1e-5 * best.mfu);
  EXPECT_EQ(std::stoll(values.at("predicted_memory_bytes")), best.memory.total());
  EXPECT_EQ(values.at("predicted_fits"), "1");
  EXPECT_EQ(values.at("predicted_flags"), best.layout.flags());
  // The breakdown's parts add up to the step.
  const plan::StepTime& t = best.time;
  EXPECT_NEAR(t.compute + t.tensor_parallel + t.context_parallel + t.expert_parallel + t.pipeline_bubble +
                  t.data_parallel + t.zero + t.optimizer,
              t.step, 1e-9 * t.step);
  EXPECT_NE(plan::explain(best, c).find("memory of the fullest rank"), std::string::npos);
}

}  // namespace
}  // namespace tessera::testing
