// `tessera selfcheck --cluster` (apps/selfcheck_cluster.h): the arithmetic,
// link and layout checks of an allocation, its calibration, and the cluster
// file for `tessera plan --cluster FILE`. Every rank runs every step and
// reaches the same verdicts from gathered figures, so all return the same
// exit status; a rank that throws ends the job through main()'s MPI_Abort.
// TESSERA_FAULT=selfcheck_gemm:R / selfcheck_payload:R (core/fault.h) make
// rank R's arithmetic or payload wrong, so tests can prove the checks fail.
#include "apps/selfcheck_cluster.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "apps/cluster_file.h"
#include "apps/trainer.h"
#include "core/context.h"
#include "core/error.h"
#include "core/fault.h"
#include "kernels/ops.h"
#include "parallel/mpi_communicator.h"
#include "plan/calibration.h"

namespace tessera::app {
namespace {

using parallel::Communicator;

// What the steps found: one line per check for the summary and the file.
struct Findings {
  std::vector<std::string> results;  // "arithmetic: agree", ...
  bool failed = false;
  void add(const std::string& line, bool ok) {
    results.push_back(line);
    failed = failed || !ok;
  }
};

// Where each rank runs: node and local rank, gathered once.
struct Placement {
  std::vector<int> node, local;
  std::string of(int rank) const {
    return "rank " + std::to_string(rank) + " (node " + std::to_string(node[size_t(rank)]) + ", local rank " +
           std::to_string(local[size_t(rank)]) + ")";
  }
};

void say(const Communicator& world, const std::string& line) {
  if (world.rank() != 0) return;
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

Placement gather_placement(Communicator& world, Context& ctx, const parallel::MpiEnv& env) {
  Tensor mine = ctx.from_vector(Shape{2}, std::vector<int64_t>{env.node_index(), env.local_rank()});
  Tensor all = ctx.empty(Shape{2 * int64_t(world.size())}, DType::i64);
  world.all_gather(mine, all)->wait();
  const std::vector<int64_t> values = all.to_vector<int64_t>();
  Placement p;
  for (size_t r = 0; r < size_t(world.size()); ++r) {
    p.node.push_back(int(values[2 * r]));
    p.local.push_back(int(values[2 * r + 1]));
  }
  return p;
}

// ---- a. Arithmetic agreement ----

// A result's f64 sum and its bytes' FNV-1a hash, as bytes to gather.
std::vector<uint8_t> checksum(const Tensor& t, bool perturb) {
  const std::vector<double> values = t.to_doubles();
  double sum = 0;
  for (const double v : values) sum += v;
  uint64_t hash = 1469598103934665603ull;
  const auto* bytes = static_cast<const uint8_t*>(t.data_ptr());
  for (size_t i = 0; i < t.nbytes(); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
  if (perturb) sum += 1.0, hash ^= 1;  // TESSERA_FAULT=selfcheck_gemm
  std::vector<uint8_t> out(16);
  std::memcpy(out.data(), &sum, 8);
  std::memcpy(out.data() + 8, &hash, 8);
  return out;
}

// The (sum's bits, hash) pair of a gathered checksum.
std::pair<uint64_t, uint64_t> decoded(const std::vector<uint8_t>& bytes) {
  std::pair<uint64_t, uint64_t> out{0, 0};
  if (bytes.size() == 16) {
    std::memcpy(&out.first, bytes.data(), 8);
    std::memcpy(&out.second, bytes.data() + 8, 8);
  }
  return out;
}

// Names every rank whose checksum differs from the majority's; true when all agree.
bool agree_on(Communicator& world, Context& ctx, const Placement& where, const std::string& what,
              const std::vector<uint8_t>& mine, Findings& findings) {
  std::vector<std::pair<uint64_t, uint64_t>> all;
  for (const std::vector<uint8_t>& bytes : parallel::all_gather_bytes(world, ctx, mine)) all.push_back(decoded(bytes));
  std::map<std::pair<uint64_t, uint64_t>, int> votes;
  for (const auto& c : all) ++votes[c];
  // The majority; on a tie, the value rank 0 holds.
  std::pair<uint64_t, uint64_t> majority = all[0];
  for (const auto& [value, count] : votes)
    if (count > votes[majority]) majority = value;
  const int others = world.size() - 1;
  const bool tie = votes.size() > 1 && 2 * votes[majority] <= world.size();
  bool ok = true;
  for (int r = 0; r < world.size(); ++r) {
    if (all[size_t(r)] == majority) continue;
    ok = false;
    const std::string line = where.of(r) + ": its " + what + " result differs from the other " +
                             std::to_string(others) + (others == 1 ? " rank's" : " ranks'") +
                             " (a broken device or a different library" +
                             (tie ? "; no majority, so either side may be the broken one)" : ")");
    say(world, "  FAIL " + line);
    findings.add("arithmetic: " + line, false);
  }
  return ok;
}

void check_arithmetic(Communicator& world, const Placement& where, uint64_t seed, Findings& findings) {
  say(world, "[1/4] arithmetic: every rank computes the same seeded GEMM and attention forward");
  // One thread: the same summation order on every rank, whatever its cores.
  ContextOptions options;
  options.cpu_threads = 1;
  Context ctx(options);
  Tensor a = ctx.empty(Shape{192, 160}, DType::f32), b = ctx.empty(Shape{160, 224}, DType::f32);
  a.uniform_at_(seed, 1, 0, -1.0f, 1.0f);
  b.uniform_at_(seed, 2, 0, -1.0f, 1.0f);
  Tensor c = ctx.empty(Shape{192, 224}, DType::f32);
  ops::matmul(a, b, c);
  Tensor qkv = ctx.empty(Shape{2, 64, 3, 4, 16}, DType::f32);
  qkv.uniform_at_(seed, 3, 0, -1.0f, 1.0f);
  Tensor out = ctx.empty(Shape{2, 64, 4, 16}, DType::f32), lse = ctx.empty(Shape{2, 4, 64}, DType::f32);
  ops::attention_forward(qkv, out, lse);
  const bool gemm_fault = fault_due("selfcheck_gemm", 0, world.rank());
  if (gemm_fault) std::fprintf(stderr, "tessera: TESSERA_FAULT: selfcheck_gemm on rank %d\n", world.rank());
  const bool gemm = agree_on(world, ctx, where, "GEMM", checksum(c, gemm_fault), findings);
  const bool attention = agree_on(world, ctx, where, "attention", checksum(out, false), findings);
  if (gemm && attention)
    findings.add("arithmetic: GEMM and attention agree on all " + std::to_string(world.size()) + " ranks", true);
  say(world, gemm && attention ? "  ok: GEMM and attention agree bit for bit" : "  arithmetic: FAILED");
}

// ---- b. Link payloads ----

void check_payloads(Communicator& world, const Placement& where, uint64_t seed, Findings& findings) {
  const int n = world.size(), rank = world.rank();
  say(world, "[2/4] links: every rank sends a seeded 1 MiB payload to its ring neighbour");
  if (n == 1) {
    findings.add("links: one rank, no link to check", true);
    say(world, "  skipped: one rank");
    return;
  }
  Context ctx;
  const int next = (rank + 1) % n, previous = (rank + n - 1) % n;
  Tensor sent = ctx.empty(Shape{int64_t(1) << 18}, DType::f32), received = ctx.zeros(sent.shape(), DType::f32);
  Tensor expected = ctx.empty(sent.shape(), DType::f32);
  sent.uniform_at_(seed, 100 + uint64_t(rank), 0, -1.0f, 1.0f);
  expected.uniform_at_(seed, 100 + uint64_t(previous), 0, -1.0f, 1.0f);
  if (fault_due("selfcheck_payload", 0, rank)) {
    std::fprintf(stderr, "tessera: TESSERA_FAULT: selfcheck_payload on rank %d\n", rank);
    static_cast<uint8_t*>(sent.data_ptr())[12345] ^= 0x10;
  }
  world.send_recv({{parallel::P2POp::Kind::send, sent, next}, {parallel::P2POp::Kind::recv, received, previous}})
      ->wait();
  const bool intact = std::memcmp(received.data_ptr(), expected.data_ptr(), received.nbytes()) == 0;
  const std::vector<std::vector<uint8_t>> all = parallel::all_gather_bytes(world, ctx, {uint8_t(intact ? 1 : 0)});
  bool ok = true;
  for (int r = 0; r < n; ++r) {
    if (all[size_t(r)][0] == 1) continue;
    ok = false;
    const int from = (r + n - 1) % n;
    const std::string line = "rank " + std::to_string(from) + " → rank " + std::to_string(r) +
                             ": the payload arrived changed (" + where.of(from) + " to " + where.of(r) +
                             "; a faulty link, NIC or driver)";
    say(world, "  FAIL " + line);
    findings.add("links: " + line, false);
  }
  if (ok) findings.add("links: " + std::to_string(n) + " ring payloads arrived intact", true);
  if (ok) say(world, "  ok: every payload arrived intact");
}

// ---- c. Layout agreement ----

struct LayoutCase {
  std::string name;
  int tp = 1, pp = 1, cp = 1, zero = 0;
};

std::vector<LayoutCase> layouts_for(int world) {
  std::vector<LayoutCase> out = {{"dp " + std::to_string(world) + " (reference)"}};
  if (world % 2 == 0) {
    out.push_back({"tp 2", 2, 1, 1, 0});
    out.push_back({"pp 2", 1, 2, 1, 0});
  }
  if (world % 4 == 0) out.push_back({"tp 2 x pp 2", 2, 2, 1, 0});
  if (world > 1)
    for (int zero = 1; zero <= 3; ++zero) out.push_back({"zero " + std::to_string(zero), 1, 1, 1, zero});
  if (world % 2 == 0) out.push_back({"cp 2", 1, 1, 2, 0});
  return out;
}

// The small GPT every layout trains: the same global batch of 2·world
// sequences in 2 micro-batches per step, whatever the data-parallel size.
TrainConfig small_gpt(const LayoutCase& layout, int world, uint64_t seed) {
  TrainConfig c;
  c.model = nn::ModelKind::gpt;
  c.synthetic = true;
  c.vocab_size = 128;
  c.seq_length = 32;
  c.num_layers = 2;
  c.num_heads = 4;
  c.hidden_size = 64;
  c.precision = "fp32";
  c.seed = seed;
  c.train_steps = 3;
  c.threads = 1;
  c.log_interval = 1000;
  c.tensor_parallel = layout.tp;
  c.pipeline_parallel = layout.pp;
  c.context_parallel = layout.cp;
  c.zero = layout.zero;
  const int dp = world / (layout.tp * layout.pp * layout.cp);
  c.global_batch_size = 2 * world;
  c.micro_batch_size = world / dp;
  return c;
}

// Rank 0's stdout goes to /dev/null while it lives (the trainer's start-up lines).
class QuietStdout {
 public:
  explicit QuietStdout(bool quiet) {
    if (!quiet) return;
    std::fflush(stdout);
    saved_ = ::dup(STDOUT_FILENO);
    FILE* null = std::fopen("/dev/null", "w");
    if (null != nullptr && saved_ >= 0) ::dup2(::fileno(null), STDOUT_FILENO);
    if (null != nullptr) std::fclose(null);
  }
  ~QuietStdout() {
    if (saved_ < 0) return;
    std::fflush(stdout);
    ::dup2(saved_, STDOUT_FILENO);
    ::close(saved_);
  }
  QuietStdout(const QuietStdout&) = delete;
  QuietStdout& operator=(const QuietStdout&) = delete;

 private:
  int saved_ = -1;
};

// The ranks of each model replica of `layout` (rank order tp-cp-ep-dp-pp):
// "{0,1} {2,3}", the groups a mismatch points at.
std::string replica_groups(const LayoutCase& layout, int world) {
  const int inner = layout.tp * layout.cp, dp = world / (inner * layout.pp);
  std::string out;
  for (int d = 0; d < dp; ++d) {
    std::string group;
    for (int p = 0; p < layout.pp; ++p)
      for (int i = 0; i < inner; ++i) {
        if (!group.empty()) group += ',';
        group += std::to_string(i + inner * (d + dp * p));
      }
    if (!out.empty()) out += ' ';
    out += '{';
    out += group;
    out += '}';
  }
  return out;
}

void check_layouts(Communicator& world, uint64_t seed, Findings& findings) {
  const std::vector<LayoutCase> layouts = layouts_for(world.size());
  say(world, "[3/4] layouts: a small GPT (2 layers, hidden 64, seq 32, fp32) for 3 steps under " +
                 std::to_string(layouts.size()) + " layout(s), each against the data-parallel losses");
  std::vector<double> reference;
  bool ok = true;
  for (const LayoutCase& layout : layouts) {
    const auto start = std::chrono::steady_clock::now();
    TrainResult result;
    {
      const QuietStdout quiet(world.rank() == 0);
      result = train(small_gpt(layout, world.size(), seed), world);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (reference.empty()) reference = result.losses;
    double worst = 0;
    for (size_t s = 0; s < reference.size() && s < result.losses.size(); ++s)
      worst = std::max(worst, std::abs(result.losses[s] - reference[s]) / std::max(1e-12, std::abs(reference[s])));
    const bool same = result.losses.size() == reference.size() && worst <= 1e-4;
    char line[200];
    std::snprintf(line, sizeof line, "  %-22s losses %s (largest relative difference %.1e, %.2f s)",
                  layout.name.c_str(), same ? "agree" : "DIFFER", worst, seconds);
    say(world, line);
    if (!same) {
      char relative[32];
      std::snprintf(relative, sizeof relative, "%.1e", worst);
      std::string text = "layouts: ";
      text += layout.name;
      text += " gives other losses than the data-parallel layout (";
      text += relative;
      text += " relative, tolerance 1e-4); its replicas' ranks: ";
      text += replica_groups(layout, world.size());
      say(world, "  FAIL " + text);
      findings.add(text, false);
      ok = false;
    }
  }
  if (ok) findings.add("layouts: " + std::to_string(layouts.size()) + " layouts agree with data parallel", true);
}

// ---- d. Calibration and the cluster file ----

plan::Cluster calibrate(Communicator& world, const parallel::MpiEnv& env, bool quick, int threads,
                        plan::LinkCalibration& links) {
  say(world, "[4/4] calibration: this machine's GEMM, memory and attention rates, then the links");
  const int per_node = env.local_size();
  // The threads training will run with (`tessera train --threads`, same default), so the rates are its.
  ContextOptions options;
  options.cpu_threads = threads;
  Context ctx(options);
  plan::Cluster cluster;
  cluster.accelerator = plan::measure_compute(ctx, world, quick);
  links = plan::measure_links(world, per_node, quick);
  cluster.per_node = per_node;
  cluster.nodes = world.size() / per_node;
  cluster.intra = links.intra_measured ? links.intra : plan::link_named("shm", per_node);
  if (!links.intra_measured) cluster.intra.source = "not measured (one rank per node): shm's figures";
  cluster.inter = links.inter_measured ? links.inter : cluster.intra;
  if (!links.inter_measured) {
    cluster.inter.name = "none (one node)";
    cluster.inter.source = "not measured (one node): the intra link's figures";
  }
  return cluster;
}

std::string when_and_where(const Communicator& world, const parallel::MpiEnv& env) {
  char stamp[32];
  const std::time_t t = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&t, &utc);
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%MZ", &utc);
  return std::string("measured ") + stamp + ", " + std::to_string(world.size()) + " ranks on " +
         std::to_string(env.node_count()) + " node(s), rank 0 on host " + env.hostname();
}

// Rank 0 writes; every rank learns whether it could.
bool write_file(Communicator& world, Context& ctx, const std::string& path, const plan::Cluster& cluster,
                const std::vector<std::string>& notes, const std::vector<plan::LinkSample>& samples) {
  std::string error;
  if (world.rank() == 0) try {
      write_cluster_file(path, cluster, notes, samples);
    } catch (const std::exception& e) {
      error = e.what();
    }
  Tensor failed = ctx.full(Shape{1}, DType::f32, error.empty() ? 0.0 : 1.0);
  world.all_reduce(failed, parallel::ReduceOp::max)->wait();
  if (!error.empty()) std::fprintf(stderr, "tessera selfcheck --cluster: %s\n", error.c_str());
  return failed.to_vector<float>()[0] == 0.0f;
}

void print_summary(const Communicator& world, const plan::Cluster& cluster, const plan::LinkCalibration& links,
                   const Findings& findings, const std::string& path, bool written) {
  if (world.rank() != 0) return;
  std::printf("\nsummary (%d ranks: %d per node x %d node(s))\n", world.size(), cluster.per_node, cluster.nodes);
  std::printf("  %-6s %-16s %14s %14s  %s\n", "link", "name", "alpha (us)", "beta (GB/s)", "sizes");
  const auto row = [](const char* link, const plan::Link& l, bool measured) {
    std::printf("  %-6s %-16s %14.2f %14.3f  %s\n", link, l.name.c_str(), l.latency * 1e6, l.bandwidth / 1e9,
                measured ? l.source.c_str() : "not measured");
  };
  row("intra", cluster.intra, links.intra_measured);
  row("inter", cluster.inter, links.inter_measured);
  std::printf("  accelerator: %s, f32 GEMM peak %.1f GFLOP/s, memory %.1f GB/s, attention efficiency %.2f\n",
              cluster.accelerator.name.c_str(), cluster.accelerator.peak_flops_32 / 1e9,
              cluster.accelerator.memory_bandwidth / 1e9, cluster.accelerator.attention_efficiency);
  for (const std::string& line : findings.results) std::printf("  %s\n", line.c_str());
  if (written) std::printf("cluster file: %s (tessera plan --cluster %s)\n", path.c_str(), path.c_str());
  std::printf("selfcheck --cluster: %s\n", findings.failed || !written ? "FAILED" : "all checks passed");
  std::fflush(stdout);
}

}  // namespace

int run_cluster_selfcheck(const ClusterSelfcheckOptions& options, const parallel::MpiEnv& env) {
  const auto world = parallel::make_mpi_communicator(MPI_COMM_WORLD, "world");
  world->set_timeout(300.0);  // a rank that stops is named, never waited for forever
  Context ctx;
  say(*world, "tessera selfcheck --cluster: " + env.describe_layout() + (options.quick ? " (quick)" : ""));
  const Placement where = gather_placement(*world, ctx, env);
  Findings findings;
  check_arithmetic(*world, where, options.seed, findings);
  check_payloads(*world, where, options.seed, findings);
  check_layouts(*world, options.seed, findings);
  plan::LinkCalibration links;
  const plan::Cluster cluster = calibrate(*world, env, options.quick, options.threads, links);
  std::vector<std::string> notes = findings.results;
  notes.push_back(when_and_where(*world, env));
  const bool written = write_file(*world, ctx, options.output, cluster, notes, links.samples);
  print_summary(*world, cluster, links, findings, options.output, written);
  return findings.failed || !written ? 1 : 0;
}

}  // namespace tessera::app
