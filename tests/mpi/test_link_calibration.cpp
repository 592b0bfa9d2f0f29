// plan::measure_links (plan/link_calibration.cpp) under mpiexec on 2 and 4
// ranks: every sample is a real timed collective (seconds > 0) whose bus
// bandwidth is nccl-tests' formula of its bytes and seconds (recomputed here
// from the factors written out), the fitted β is within a factor of 3 of the
// median measured bus bandwidth at the largest size and α is positive; the
// link classes follow ranks_per_node (one node: intra only; one rank per
// node: inter only; 2 per node on 4 ranks: both, groups of 2); a world of one
// measures nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "plan/calibration.h"
#include "tests/mpi/mpi_test.h"

namespace tessera::testing {
namespace {

// nccl-tests' bus bandwidth factor of each collective over n ranks.
double bus_factor(const std::string& collective, int n) {
  if (collective == "all_reduce") return 2.0 * (n - 1) / n;
  if (collective == "send_recv") return 1.0;
  return double(n - 1) / n;
}

void expect_sane(const plan::LinkCalibration& links, const std::string& link, int group) {
  std::vector<double> largest;
  double largest_bytes = 0;
  int count = 0;
  for (const plan::LinkSample& s : links.samples) {
    if (s.link != link) continue;
    ++count;
    EXPECT_GT(s.seconds, 0) << s.collective << " " << s.bytes;
    EXPECT_EQ(s.ranks, group);
    EXPECT_NEAR(s.bus_bandwidth, s.bytes / s.seconds * bus_factor(s.collective, s.ranks), 1e-6 * s.bus_bandwidth)
        << s.collective << " " << s.bytes;
    largest_bytes = std::max(largest_bytes, s.bytes);
  }
  EXPECT_EQ(count, 4 * 5) << link << ": 4 collectives x 5 sizes (4 KiB to 1 MiB) in quick mode";
  EXPECT_GE(largest_bytes, 1024.0 * 1024 * 0.99);
  for (const plan::LinkSample& s : links.samples)
    if (s.link == link && s.bytes == largest_bytes && s.collective != "send_recv") largest.push_back(s.bus_bandwidth);
  ASSERT_FALSE(largest.empty());
  std::sort(largest.begin(), largest.end());
  const double median = largest[largest.size() / 2];
  const plan::Link& fitted = link == "intra" ? links.intra : links.inter;
  std::string table;  // the samples, for a failure's message
  for (const plan::LinkSample& s : links.samples)
    if (s.link == link)
      table += s.collective + " " + std::to_string(int64_t(s.bytes)) + " B " + std::to_string(s.seconds * 1e6) +
               " us " + std::to_string(s.bus_bandwidth / 1e9) + " GB/s\n";
  EXPECT_GT(fitted.latency, 0);
  EXPECT_GT(fitted.bandwidth, median / 3) << link << ", fitted latency " << fitted.latency << " s:\n" << table;
  EXPECT_LT(fitted.bandwidth, median * 3) << link << ", fitted latency " << fitted.latency << " s:\n" << table;
  EXPECT_EQ(fitted.name, "measured-" + link);
  EXPECT_NE(fitted.source.find("tessera selfcheck --cluster"), std::string::npos) << fitted.source;
}

TEST(MeasureLinks, OneNodeMeasuresTheIntraLinks) {
  auto comm = world();
  const plan::LinkCalibration links = plan::measure_links(*comm, comm->size(), true);
  EXPECT_TRUE(links.intra_measured);
  EXPECT_FALSE(links.inter_measured);
  expect_sane(links, "intra", comm->size());
}

TEST(MeasureLinks, OneRankPerNodeMeasuresTheInterLinks) {
  auto comm = world();
  const plan::LinkCalibration links = plan::measure_links(*comm, 1, true);
  EXPECT_FALSE(links.intra_measured);
  EXPECT_TRUE(links.inter_measured);
  expect_sane(links, "inter", comm->size());
}

TEST(MeasureLinks, TwoPerNodeOnFourRanksMeasuresBoth) {
  auto comm = world();
  if (comm->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const plan::LinkCalibration links = plan::measure_links(*comm, 2, true);
  EXPECT_TRUE(links.intra_measured);
  EXPECT_TRUE(links.inter_measured);
  expect_sane(links, "intra", 2);
  expect_sane(links, "inter", 2);
}

TEST(MeasureLinks, AWorldOfOneMeasuresNothing) {
  auto comm = world();
  const auto alone = comm->split(comm->rank(), 0, "alone");
  const plan::LinkCalibration links = plan::measure_links(*alone, 1, true);
  EXPECT_FALSE(links.intra_measured);
  EXPECT_FALSE(links.inter_measured);
  EXPECT_TRUE(links.samples.empty());
}

TEST(MeasureLinks, RanksThatAreNotWholeNodesAreRefused) {
  auto comm = world();
  if (comm->size() % 3 == 0) GTEST_SKIP();
  EXPECT_THROW(plan::measure_links(*comm, 3, true), Error);
}

}  // namespace
}  // namespace tessera::testing
