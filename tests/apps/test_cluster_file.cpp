// app::write_cluster_file against app::read_cluster_file (apps/cluster_file.h):
// random Clusters (every field of the accelerator, its GEMM grids, both
// links with their sources) written and read back are equal field by field,
// bit for bit for the doubles; the [selfcheck] notes and [[link_samples]] are
// in the file and ignored by the reader; a directory that is not there is
// refused naming the file and the flag.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "apps/cluster_file.h"
#include "core/error.h"
#include "tests/support/resume_support.h"

namespace tessera::testing {
namespace {

plan::Cluster random_cluster(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> unit(0.01, 1.0), exponent(-9.0, 15.0);
  std::uniform_int_distribution<int> small(1, 64);
  const auto any = [&] { return unit(rng) * std::pow(10.0, exponent(rng)); };
  plan::Cluster c;
  c.per_node = small(rng);
  c.nodes = small(rng);
  plan::Accelerator& a = c.accelerator;
  a.name = "accel-" + std::to_string(small(rng));
  a.peak_flops_16 = any(), a.peak_flops_32 = any(), a.memory_bandwidth = any();
  a.memory_bytes = int64_t(small(rng)) * 123456789;
  a.compute_units = small(rng);
  a.tile_m = small(rng), a.tile_n = small(rng);
  a.gemm_efficiency = unit(rng), a.memory_efficiency = unit(rng), a.attention_efficiency = unit(rng);
  a.launch_seconds = any();
  a.source = "measured \"here\" on a test, line 1";
  for (int i = 0; i < small(rng) % 5 + 1; ++i) a.gemm_rates_32.push_back({small(rng), small(rng), small(rng), any()});
  for (int i = 0; i < small(rng) % 3; ++i) a.gemm_rates_16.push_back({small(rng), small(rng), small(rng), any()});
  c.intra = {"measured-intra", any(), any(), "tessera selfcheck --cluster: 4 ranks"};
  c.inter = {"measured-inter", any(), any(), "across nodes"};
  return c;
}

void expect_same_rates(const std::vector<plan::GemmRate>& a, const std::vector<plan::GemmRate>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].m, b[i].m);
    EXPECT_EQ(a[i].n, b[i].n);
    EXPECT_EQ(a[i].k, b[i].k);
    EXPECT_EQ(a[i].flops, b[i].flops);
  }
}

void expect_same_link(const plan::Link& a, const plan::Link& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.bandwidth, b.bandwidth);
  EXPECT_EQ(a.latency, b.latency);
  EXPECT_EQ(a.source, b.source);
}

TEST(ClusterFile, RandomClustersReadBackEqual) {
  ScratchDirectory dir("tessera_cluster_file_");
  std::mt19937_64 rng(20261128);
  for (int trial = 0; trial < 20; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const plan::Cluster c = random_cluster(rng);
    const std::string path = (dir.path / ("c" + std::to_string(trial) + ".toml")).string();
    plan::LinkSample sample{"all_reduce", "intra", 4, 4096, 1.5e-5, 4.1e8};
    app::write_cluster_file(path, c, {"arithmetic: agree", "links: intact"}, {sample});
    const plan::Cluster r = app::read_cluster_file(path);
    EXPECT_EQ(r.per_node, c.per_node);
    EXPECT_EQ(r.nodes, c.nodes);
    const plan::Accelerator &x = c.accelerator, &y = r.accelerator;
    EXPECT_EQ(y.name, x.name);
    EXPECT_EQ(y.peak_flops_16, x.peak_flops_16);
    EXPECT_EQ(y.peak_flops_32, x.peak_flops_32);
    EXPECT_EQ(y.memory_bytes, x.memory_bytes);
    EXPECT_EQ(y.memory_bandwidth, x.memory_bandwidth);
    EXPECT_EQ(y.compute_units, x.compute_units);
    EXPECT_EQ(y.tile_m, x.tile_m);
    EXPECT_EQ(y.tile_n, x.tile_n);
    EXPECT_EQ(y.gemm_efficiency, x.gemm_efficiency);
    EXPECT_EQ(y.attention_efficiency, x.attention_efficiency);
    EXPECT_EQ(y.memory_efficiency, x.memory_efficiency);
    EXPECT_EQ(y.launch_seconds, x.launch_seconds);
    EXPECT_EQ(y.source, x.source);
    expect_same_rates(y.gemm_rates_32, x.gemm_rates_32);
    expect_same_rates(y.gemm_rates_16, x.gemm_rates_16);
    expect_same_link(r.intra, c.intra);
    expect_same_link(r.inter, c.inter);
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    EXPECT_NE(text.str().find("[selfcheck]"), std::string::npos);
    EXPECT_NE(text.str().find("arithmetic: agree"), std::string::npos);
    EXPECT_NE(text.str().find("[[link_samples]]"), std::string::npos);
    EXPECT_FALSE(std::filesystem::exists(path + ".partial"));
  }
}

TEST(ClusterFile, AnUnwritablePathIsRefusedNamingIt) {
  ScratchDirectory dir("tessera_cluster_file_");
  const std::string path = (dir.path / "missing" / "c.toml").string();
  std::mt19937_64 rng(1);
  try {
    app::write_cluster_file(path, random_cluster(rng), {});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--output"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera::testing
