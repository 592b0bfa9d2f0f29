// Tensor views, copies, fills, and the types beneath them (Shape, Device,
// DType, Error).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "core/context.h"
#include "core/stream.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

TEST(Tensor, SliceSelectAndReshapeShareStorage) {
  Context ctx;
  std::vector<float> values(6 * 5);
  for (size_t i = 0; i < values.size(); ++i) values[i] = float(i) + 0.5f;
  Tensor t = ctx.from_vector(Shape{6, 5}, values);
  Tensor rows = t.slice(2, 4);
  EXPECT_EQ(rows.shape(), (Shape{2, 5}));
  EXPECT_TRUE(rows.shares_storage_with(t));
  EXPECT_EQ(rows.to_vector<float>(), std::vector<float>(values.begin() + 10, values.begin() + 20));
  Tensor row = t.select(5);
  EXPECT_EQ(row.shape(), (Shape{5}));
  EXPECT_EQ(row.to_vector<float>()[4], values[29]);
  Tensor r = t.reshape({3, -1});
  EXPECT_EQ(r.shape(), (Shape{3, 10}));
  rows.fill_(-1.0);  // writes through the view
  const auto after = t.to_vector<float>();
  for (size_t i = 0; i < after.size(); ++i) EXPECT_EQ(after[i], (i >= 10 && i < 20) ? -1.0f : values[i]) << i;
  EXPECT_THROW(t.slice(4, 7), Error);
  EXPECT_THROW(t.reshape({4, -1}), Error);
  EXPECT_THROW(t.view(Shape{31}), Error);
}

TEST(Tensor, CopyCloneAndFillEveryDtype) {
  Context ctx;
  for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
    Tensor t = ctx.full(Shape{1000, 3}, dtype, 7.0);
    for (double v : t.to_doubles()) ASSERT_EQ(v, 7.0) << dtype_name(dtype);
    Tensor c = t.clone();
    EXPECT_FALSE(c.shares_storage_with(t));
    t.fill_(2.0);
    for (double v : c.to_doubles()) ASSERT_EQ(v, 7.0) << dtype_name(dtype);
    c.copy_(t);
    for (double v : c.to_doubles()) ASSERT_EQ(v, 2.0) << dtype_name(dtype);
  }
  Tensor a = ctx.zeros(Shape{4}, DType::f32), b = ctx.zeros(Shape{4}, DType::bf16), d = ctx.zeros(Shape{5}, DType::f32);
  EXPECT_THROW(a.copy_(b), Error);
  EXPECT_THROW(a.copy_(d), Error);
}

TEST(Tensor, LargeHostCopyIsExact) {
  TESSERA_SEED_TRACE();
  Context ctx;
  auto rng = make_rng();
  auto x = random_tensor(ctx, Shape{3001, 1009}, DType::f32, rng);  // > the copy's threading grain
  Tensor y = poisoned(ctx, Shape{3001, 1009}, DType::f32);
  y.copy_(x.tensor);
  EXPECT_EQ(y.to_doubles(), x.values);
}

TEST(Tensor, GpuRoundTripAndDeviceAllocatorCounters) {
  TESSERA_SEED_TRACE();
  Context ctx;
  TESSERA_REQUIRE_GPU(ctx);
  auto rng = make_rng();
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    auto x = random_tensor(ctx, Shape{513, 31}, dtype, rng);
    Tensor g = x.tensor.to(Device::cuda(0));
    EXPECT_EQ(g.device(), Device::cuda(0));
    Tensor g2 = g.clone();
    g.fill_(3.0);
    EXPECT_EQ(g2.to_doubles(), x.values);
    for (double v : g.to_doubles()) ASSERT_EQ(v, 3.0);
  }
  Allocator& device = ctx.allocator(Device::cuda(0));
  const size_t before = device.stats().allocated_bytes;
  {
    Tensor big = ctx.empty(Shape{1 << 20}, DType::f32, Device::cuda(0));
    EXPECT_GE(device.stats().allocated_bytes, before + (4 << 20));
  }
  EXPECT_EQ(device.stats().allocated_bytes, before);
}

TEST(Tensor, StreamsAndEventsOnTheCpuAreInline) {
  Stream s = Stream::cpu();
  Event start(Device::cpu(), true), end(Device::cpu(), true);
  start.record(s);
  end.record(s);
  EXPECT_TRUE(end.ready());
  EXPECT_GE(start.elapsed_ms(end), 0.0f);
  s.synchronize();
}

TEST(Types, ParseAndPrint) {
  EXPECT_EQ(parse_dtype("bf16"), DType::bf16);
  EXPECT_EQ(parse_dtype("float32"), DType::f32);
  EXPECT_THROW(parse_dtype("f64"), Error);
  EXPECT_EQ(parse_device("cuda:3"), Device::cuda(3));
  EXPECT_EQ(parse_device("cpu"), Device::cpu());
  EXPECT_EQ(Device::cuda(1).to_string(), "cuda:1");
  EXPECT_THROW(parse_device("cuda:x"), Error);
  EXPECT_THROW(parse_device("tpu"), Error);
  EXPECT_EQ((Shape{2, 3, 4}).numel(), 24);
  EXPECT_EQ((Shape{2, 3, 4}).to_string(), "[2, 3, 4]");
  EXPECT_EQ((Shape{2, 3, 4})[-1], 4);
  EXPECT_THROW((Shape{2, -3}), Error);
}

TEST(Errors, NameTheRankTheSiteAndTheDevice) {
  setenv("OMPI_COMM_WORLD_RANK", "3", 1);
  try {
    TESSERA_CHECK_ON(Device::cuda(1), 1 + 1 == 3, "arithmetic is broken: ", 42);
    FAIL() << "no throw";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_EQ(error.rank(), 3);
    EXPECT_NE(what.find("[rank 3]"), std::string::npos) << what;
    EXPECT_NE(what.find("arithmetic is broken: 42"), std::string::npos) << what;
    EXPECT_NE(what.find("test_tensor.cpp:"), std::string::npos) << what;
    EXPECT_NE(what.find("1 + 1 == 3"), std::string::npos) << what;
    EXPECT_NE(what.find("cuda:1"), std::string::npos) << what;
  }
  unsetenv("OMPI_COMM_WORLD_RANK");
}

TEST(Errors, CudaTensorWithoutADeviceSaysWhy) {
  Context ctx;
  if (ctx.cuda_device_count() > 0) GTEST_SKIP() << "a GPU exists here; this checks the message without one";
  try {
    ctx.empty(Shape{4}, DType::f32, Device::cuda(0));
    FAIL() << "no throw";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_TRUE(what.find("0 CUDA device") != std::string::npos ||
                what.find("without the CUDA backend") != std::string::npos)
        << what;
  }
}

}  // namespace
}  // namespace tessera::testing
