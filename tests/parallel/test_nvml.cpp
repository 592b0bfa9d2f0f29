// parallel/nvml.h against the NVML stand-in (tests/support/nvml_stand_in.cpp,
// readings set per test): the GPUs' bus ids, finding a GPU by CUDA's PCI bus
// id or by index, every reading converted to base units (percent to a ratio,
// milliwatts to watts, MHz to Hz), a failing call leaving out only its field,
// and no library or a failing nvmlInit answering nothing without an error.
#include <gtest/gtest.h>

#include "parallel/nvml.h"
#include "tests/support/nvml_stand_in.h"

namespace tessera::parallel {
namespace {

using testing::NvmlStandIn;

TEST(Nvml, ListsTheGpusByBusIdInIndexOrder) {
  NvmlStandIn stand_in;
  stand_in.two_gpus();
  const Nvml nvml(NvmlStandIn::library());
  ASSERT_TRUE(nvml.available());
  EXPECT_EQ(nvml.gpu_bus_ids(), (std::vector<std::string>{"00000000:3B:00.0", "00000000:86:00.0"}));
}

TEST(Nvml, FindsTheGpuByCudasPciBusIdElseByIndex) {
  NvmlStandIn stand_in;
  stand_in.two_gpus();
  const Nvml nvml(NvmlStandIn::library());
  EXPECT_EQ(nvml.find_gpu("0000:86:00.0", 0), 1u);  // CUDA's form, CUDA's index 0 (CUDA_VISIBLE_DEVICES=1)
  EXPECT_EQ(nvml.find_gpu("0000:3b:00.0", 1), 0u);
  EXPECT_EQ(nvml.find_gpu("", 1), 1u);
  EXPECT_EQ(nvml.find_gpu("0000:99:00.0", 0), std::nullopt);
  EXPECT_EQ(nvml.find_gpu("", 2), std::nullopt);
}

TEST(Nvml, ReadingsAreInBaseUnits) {
  NvmlStandIn stand_in;
  stand_in.two_gpus();
  const Nvml nvml(NvmlStandIn::library());
  const GpuSample sample = nvml.sample(1);
  EXPECT_DOUBLE_EQ(sample.utilization_ratio.value(), 87 / 100.0);
  EXPECT_EQ(sample.memory_used_bytes, 81604378624.0);
  EXPECT_EQ(sample.memory_total_bytes, 85520809984.0);
  EXPECT_DOUBLE_EQ(sample.power_watts.value(), 699.123);
  EXPECT_EQ(sample.temperature_celsius, 71.0);
  EXPECT_EQ(sample.sm_clock_hertz, 1980e6);
  EXPECT_EQ(sample.memory_clock_hertz, 2619e6);
  EXPECT_DOUBLE_EQ(nvml.sample(0).power_watts.value(), 71.25);
}

TEST(Nvml, AFailingCallLeavesOutOnlyItsField) {
  NvmlStandIn stand_in;
  stand_in.two_gpus();
  stand_in.set("POWER_MW", "fail,fail").set("SM_CLOCK_MHZ", "345,fail");
  const Nvml nvml(NvmlStandIn::library());
  const GpuSample sample = nvml.sample(1);
  EXPECT_FALSE(sample.power_watts.has_value());
  EXPECT_FALSE(sample.sm_clock_hertz.has_value());
  EXPECT_EQ(sample.memory_clock_hertz, 2619e6);
  EXPECT_EQ(sample.temperature_celsius, 71.0);
  EXPECT_DOUBLE_EQ(sample.utilization_ratio.value(), 0.87);
  EXPECT_EQ(nvml.sample(0).sm_clock_hertz, 345e6);
  EXPECT_FALSE(nvml.sample(2).temperature_celsius.has_value());  // no such GPU: nothing
}

TEST(Nvml, NoLibraryOrAFailedStartAnswersNothing) {
  const Nvml missing("/nonexistent/libnvidia-ml.so.1");
  EXPECT_FALSE(missing.available());
  EXPECT_EQ(missing.gpu_bus_ids(), std::nullopt);
  EXPECT_EQ(missing.find_gpu("", 0), std::nullopt);
  EXPECT_FALSE(missing.sample(0).utilization_ratio.has_value());

  NvmlStandIn stand_in;
  stand_in.two_gpus();
  stand_in.set("INIT", "fail");
  const Nvml failed(NvmlStandIn::library());
  EXPECT_FALSE(failed.available());
  EXPECT_EQ(failed.gpu_bus_ids(), std::nullopt);
  EXPECT_FALSE(failed.sample(0).memory_used_bytes.has_value());
}

}  // namespace
}  // namespace tessera::parallel
