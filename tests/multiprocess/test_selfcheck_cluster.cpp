// `tessera selfcheck --cluster` as a user runs it: the real binary under
// mpiexec on 2 ranks (--quick). A clean run exits 0 with the summary and
// writes a cluster file that app::read_cluster_file reads (2 per node, one
// node, the intra bandwidth the file's [intra] table says, read here from the
// text); TESSERA_FAULT=selfcheck_gemm:1 and selfcheck_payload:1 (rank 1's
// GEMM checksum perturbed, a bit of its payload flipped) make it exit non-zero
// naming rank 1, on every rank.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "apps/cluster_file.h"
#include "tests/support/process_job.h"
#include "tests/support/resume_support.h"

namespace tessera::testing {
namespace {

std::vector<std::string> selfcheck_command(const std::string& output) {
  return {TESSERA_MPIEXEC, "-np",       "2",         "--oversubscribe", "--bind-to", "none",
          TESSERA_BINARY,  "selfcheck", "--cluster", "--quick",         "--output",  output};
}

// [intra]'s bandwidth as the file's text writes it.
double intra_bandwidth_in(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::smatch match;
  const std::string all = text.str();
  const std::regex intra(R"(\[intra\][^\[]*?bandwidth = ([0-9.eE+-]+))");
  if (!std::regex_search(all, match, intra)) return -1;
  return std::stod(match[1].str());
}

TEST(SelfcheckCluster, TwoRanksPassAndWriteTheClusterFile) {
  ScratchDirectory dir("tessera_selfcheck_cluster_");
  const std::string file = dir / "cluster.toml";
  const Outcome out = run_command(selfcheck_command(file), dir / "log", seconds(120));
  ASSERT_EQ(out.status, 0) << out.output;
  EXPECT_TRUE(contains(out.output, "summary (2 ranks: 2 per node x 1 node(s))")) << out.output;
  EXPECT_TRUE(contains(out.output, "arithmetic: GEMM and attention agree on all 2 ranks")) << out.output;
  EXPECT_TRUE(contains(out.output, "links: 2 ring payloads arrived intact")) << out.output;
  EXPECT_TRUE(contains(out.output, "layouts: 7 layouts agree with data parallel")) << out.output;
  EXPECT_TRUE(contains(out.output, "selfcheck --cluster: all checks passed")) << out.output;
  const plan::Cluster cluster = app::read_cluster_file(file);
  EXPECT_EQ(cluster.per_node, 2);
  EXPECT_EQ(cluster.nodes, 1);
  EXPECT_EQ(cluster.intra.name, "measured-intra");
  EXPECT_GT(cluster.intra.bandwidth, 0);
  EXPECT_GT(cluster.intra.latency, 0);
  EXPECT_EQ(cluster.intra.bandwidth, intra_bandwidth_in(file));
  EXPECT_EQ(cluster.accelerator.name, "cpu");
  EXPECT_FALSE(cluster.accelerator.gemm_rates_32.empty());
}

// The run with TESSERA_FAULT=`fault`: it must fail, on every rank (mpiexec's status).
Outcome run_with_fault(const std::string& fault) {
  ScratchDirectory dir("tessera_selfcheck_cluster_");
  Outcome out = run_command(selfcheck_command(dir / "c.toml"), dir / "log", seconds(120),
                            job_environment({}, {"TESSERA_FAULT=" + fault}));
  EXPECT_NE(out.status, 0) << out.output;
  EXPECT_TRUE(contains(out.output, "selfcheck --cluster: FAILED")) << out.output;
  EXPECT_FALSE(out.left) << "processes left running";
  return out;
}

TEST(SelfcheckCluster, AWrongGemmOnRankOneIsNamed) {
  const Outcome out = run_with_fault("selfcheck_gemm:1");
  EXPECT_TRUE(contains(out.output, "rank 1 (node 0, local rank 1): its GEMM result differs")) << out.output;
  EXPECT_FALSE(contains(out.output, "rank 0 (node 0, local rank 0): its GEMM")) << out.output;
  EXPECT_TRUE(contains(out.output, "links: 2 ring payloads arrived intact")) << out.output;
}

TEST(SelfcheckCluster, AChangedPayloadFromRankOneNamesThePair) {
  const Outcome out = run_with_fault("selfcheck_payload:1");
  EXPECT_TRUE(contains(out.output, "rank 1 → rank 0: the payload arrived changed")) << out.output;
  EXPECT_FALSE(contains(out.output, "rank 0 → rank 1")) << out.output;
  EXPECT_TRUE(contains(out.output, "arithmetic: GEMM and attention agree on all 2 ranks")) << out.output;
}

}  // namespace
}  // namespace tessera::testing
