// parallel/nvml.h against the NVML stand-in (tests/support/nvml_stand_in.cpp,
// readings set per test): the GPUs' bus ids; finding a GPU or a MIG slice by
// CUDA's UUID (either form, never by index); every reading converted to base
// units (percent to a ratio, milliwatts to watts, MHz to Hz); a slice's own
// memory and only the fields a slice has; a failing call leaving out only its
// field; and no library or a failing nvmlInit answering nothing without an
// error.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <tuple>

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

// CUDA's 16 bytes of a UUID written as NVML writes it, from NVML's text.
std::array<unsigned char, 16> uuid_bytes(const std::string& nvml_uuid) {
  std::string hex;
  for (const char c : nvml_uuid.substr(4))
    if (c != '-') hex += c;
  std::array<unsigned char, 16> bytes{};
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = (unsigned char)std::stoul(hex.substr(2 * i, 2), nullptr, 16);
  return bytes;
}

TEST(Nvml, CudasUuidIsWrittenAsNvmlWritesItWithoutThePrefix) {
  std::array<unsigned char, 16> counting{};
  for (size_t i = 0; i < counting.size(); ++i) counting[i] = (unsigned char)(i * 17);
  EXPECT_EQ(uuid_text(counting), "00112233-4455-6677-8899-aabbccddeeff");
  for (const std::string uuid : {NvmlStandIn::kGpu1, NvmlStandIn::kSlice1})
    EXPECT_EQ(uuid_text(uuid_bytes(uuid)), uuid.substr(4));
}

TEST(Nvml, FindsTheGpuByUuidWhateverCudasIndexIs) {
  NvmlStandIn stand_in;
  stand_in.two_gpus();
  const Nvml nvml(NvmlStandIn::library());
  // CUDA's device 0 under CUDA_VISIBLE_DEVICES=1 is NVML's 1; its UUID says so.
  const std::optional<GpuLocation> second = nvml.find_gpu(uuid_text(uuid_bytes(NvmlStandIn::kGpu1)));
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->index, 1u);
  EXPECT_FALSE(second->mig_mode);
  EXPECT_FALSE(second->slice.has_value());
  EXPECT_EQ(nvml.find_gpu(NvmlStandIn::kGpu0).value().index, 0u);  // NVML's own form
  std::string upper = NvmlStandIn::kGpu0;
  std::transform(upper.begin(), upper.end(), upper.begin(), [](unsigned char c) { return char(std::toupper(c)); });
  EXPECT_EQ(nvml.find_gpu(upper).value().index, 0u);
  EXPECT_EQ(nvml.find_gpu("00000000-0000-0000-0000-000000000000"), std::nullopt);
  EXPECT_EQ(nvml.find_gpu(""), std::nullopt) << "no UUID: no guess from CUDA's index";
}

TEST(Nvml, FindsAMigSliceByItsUuidWithItsInstances) {
  NvmlStandIn stand_in;
  stand_in.two_gpus_one_split();
  const Nvml nvml(NvmlStandIn::library());
  for (const auto& [uuid, mig_index, gpu_instance] :
       {std::tuple{std::string(NvmlStandIn::kSlice0), 0u, 1u}, {std::string(NvmlStandIn::kSlice1), 3u, 2u}}) {
    const std::optional<GpuLocation> slice = nvml.find_gpu(uuid_text(uuid_bytes(uuid)));  // CUDA's form
    ASSERT_TRUE(slice.has_value()) << uuid;
    EXPECT_EQ(slice->index, 1u);
    EXPECT_TRUE(slice->mig_mode);
    ASSERT_TRUE(slice->slice.has_value());
    EXPECT_EQ(slice->slice->device_index, mig_index);
    EXPECT_EQ(slice->slice->gpu_instance, gpu_instance);
    EXPECT_EQ(slice->slice->compute_instance, 0u);
    EXPECT_EQ(nvml.find_gpu(uuid).value().slice.value().gpu_instance, gpu_instance);  // NVML's "MIG-" form
  }
  const std::optional<GpuLocation> board = nvml.find_gpu(NvmlStandIn::kGpu1);
  ASSERT_TRUE(board.has_value());
  EXPECT_TRUE(board->mig_mode);
  EXPECT_FALSE(board->slice.has_value());
}

TEST(Nvml, ASliceReportsItsOwnMemoryAndNoUtilisationOrPower) {
  NvmlStandIn stand_in;
  stand_in.two_gpus_one_split();
  const Nvml nvml(NvmlStandIn::library());
  const GpuSample first = nvml.sample(nvml.find_gpu(NvmlStandIn::kSlice0).value());
  const GpuSample second = nvml.sample(nvml.find_gpu(NvmlStandIn::kSlice1).value());
  EXPECT_EQ(first.memory_used_bytes, 3221225472.0);  // the slice's, not the board's 81604378624
  EXPECT_EQ(first.memory_total_bytes, 42949672960.0);
  EXPECT_EQ(second.memory_used_bytes, 7516192768.0);
  EXPECT_EQ(second.memory_total_bytes, 21474836480.0);
  for (const GpuSample& slice : {first, second}) {
    EXPECT_FALSE(slice.utilization_ratio.has_value());
    EXPECT_FALSE(slice.power_watts.has_value()) << "the board's draw is every slice's";
    EXPECT_EQ(slice.temperature_celsius, 71.0);  // the board's, which the slice shares
    EXPECT_EQ(slice.sm_clock_hertz, 1980e6);
    EXPECT_EQ(slice.memory_clock_hertz, 2619e6);
  }
  const GpuSample board = nvml.sample(nvml.find_gpu(NvmlStandIn::kGpu1).value());
  EXPECT_FALSE(board.memory_used_bytes.has_value()) << "under MIG the board's memory is every slice's";
  EXPECT_FALSE(board.power_watts.has_value());
  EXPECT_EQ(board.temperature_celsius, 71.0);
  EXPECT_DOUBLE_EQ(nvml.sample(nvml.find_gpu(NvmlStandIn::kGpu0).value()).utilization_ratio.value(), 0.12)
      << "the other GPU is not in MIG mode";
}

TEST(Nvml, TheFieldsASliceCannotReportAreNamed) {
  const GpuLocation whole{0, false, std::nullopt}, slice{1, true, GpuLocation::MigSlice{0, 1, 0}},
      board{1, true, std::nullopt};
  EXPECT_EQ(unreported_fields(fields_of(whole)), "");
  EXPECT_EQ(unreported_fields(fields_of(slice)), "utilization, power");
  EXPECT_EQ(unreported_fields(fields_of(board)), "utilization, memory, power");
}

TEST(Nvml, ReadingsAreInBaseUnits) {
  NvmlStandIn stand_in;
  stand_in.two_gpus();
  const Nvml nvml(NvmlStandIn::library());
  const GpuSample sample = nvml.sample(nvml.find_gpu(NvmlStandIn::kGpu1).value());
  EXPECT_DOUBLE_EQ(sample.utilization_ratio.value(), 87 / 100.0);
  EXPECT_EQ(sample.memory_used_bytes, 81604378624.0);
  EXPECT_EQ(sample.memory_total_bytes, 85520809984.0);
  EXPECT_DOUBLE_EQ(sample.power_watts.value(), 699.123);
  EXPECT_EQ(sample.temperature_celsius, 71.0);
  EXPECT_EQ(sample.sm_clock_hertz, 1980e6);
  EXPECT_EQ(sample.memory_clock_hertz, 2619e6);
  EXPECT_DOUBLE_EQ(nvml.sample(GpuLocation{0, false, std::nullopt}).power_watts.value(), 71.25);
}

TEST(Nvml, AFailingCallLeavesOutOnlyItsField) {
  NvmlStandIn stand_in;
  stand_in.two_gpus();
  stand_in.set("POWER_MW", "fail,fail").set("SM_CLOCK_MHZ", "345,fail");
  const Nvml nvml(NvmlStandIn::library());
  const GpuSample sample = nvml.sample(nvml.find_gpu(NvmlStandIn::kGpu1).value());
  EXPECT_FALSE(sample.power_watts.has_value());
  EXPECT_FALSE(sample.sm_clock_hertz.has_value());
  EXPECT_EQ(sample.memory_clock_hertz, 2619e6);
  EXPECT_EQ(sample.temperature_celsius, 71.0);
  EXPECT_DOUBLE_EQ(sample.utilization_ratio.value(), 0.87);
  EXPECT_EQ(nvml.sample(GpuLocation{0, false, std::nullopt}).sm_clock_hertz, 345e6);
  EXPECT_FALSE(
      nvml.sample(GpuLocation{2, false, std::nullopt}).temperature_celsius.has_value());  // no such GPU: nothing
}

TEST(Nvml, NoLibraryOrAFailedStartAnswersNothing) {
  const Nvml missing("/nonexistent/libnvidia-ml.so.1");
  EXPECT_FALSE(missing.available());
  EXPECT_EQ(missing.gpu_bus_ids(), std::nullopt);
  EXPECT_EQ(missing.find_gpu(NvmlStandIn::kGpu0), std::nullopt);
  EXPECT_FALSE(missing.sample(GpuLocation{0, false, std::nullopt}).utilization_ratio.has_value());

  NvmlStandIn stand_in;
  stand_in.two_gpus();
  stand_in.set("INIT", "fail");
  const Nvml failed(NvmlStandIn::library());
  EXPECT_FALSE(failed.available());
  EXPECT_EQ(failed.gpu_bus_ids(), std::nullopt);
  EXPECT_FALSE(failed.sample(GpuLocation{0, false, std::nullopt}).memory_used_bytes.has_value());
}

}  // namespace
}  // namespace tessera::parallel
