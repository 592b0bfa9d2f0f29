// safetensors reading (io/safetensors.h) and weights from safetensors into a
// model (io::load_safetensors_weights, what `train --init-from` calls): a
// directory stands for its model.safetensors as Hugging Face's
// from_pretrained(DIR) reads it; a file cut short is called truncated; F64
// tensors load (narrowed to the model's f32, compared with the doubles
// rounded here); a NaN or an infinity in a tensor is refused naming it.
// Files are written by hand (header text and bytes) where the writer cannot
// make them (F64), else by write_safetensors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/context.h"
#include "io/model_weights.h"
#include "io/safetensors.h"
#include "models/stage_model.h"
#include "tests/io/io_test_files.h"
#include "tests/support/error_text.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

// A whole f32 GPT on the CPU with every parameter NaN (what loading leaves
// unwritten shows), random values for its parameters, and a scratch directory.
class SafetensorsWeights : public ::testing::Test {
 protected:
  SafetensorsWeights() {
    nn::ModelConfig config;
    config.kind = nn::ModelKind::gpt;
    config.vocab_size = 16;
    config.seq_length = 8;
    config.num_layers = 1;
    config.num_heads = 2;
    config.hidden_size = 8;
    model = models::build_model(config, nn::ModelSpec{&ctx, Device::cpu(), DType::f32, 0});
    for (nn::Parameter* p : model->parameters()) p->value.fill_(std::nan(""));
  }
  std::vector<nn::Parameter*> parameters() { return model->parameters(); }
  io::WeightsLoaded load(const std::string& path) { return io::load_safetensors_weights(path, parameters(), 1); }

  std::mt19937_64 rng = make_rng();
  TempDir dir;
  Context ctx;
  std::unique_ptr<nn::Module> model;
};

// Random values for each parameter of `model`, in its order.
std::vector<std::vector<double>> random_values(nn::Module& model, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> value(-2.0, 2.0);
  std::vector<std::vector<double>> values;
  for (const nn::Parameter* p : model.parameters()) {
    values.emplace_back(size_t(p->value.numel()));
    for (double& v : values.back()) v = value(rng);
  }
  return values;
}

std::vector<float> as_floats(const std::vector<double>& values) {
  return std::vector<float>(values.begin(), values.end());
}

// The values written as F32 under Tessera's names by write_safetensors.
void write_f32(const std::string& path, nn::Module& model, const std::vector<std::vector<double>>& values) {
  std::vector<std::vector<float>> data;
  for (const auto& v : values) data.push_back(as_floats(v));
  std::vector<io::SafetensorsInput> inputs;
  const std::vector<nn::Parameter*> parameters = model.parameters();
  for (size_t i = 0; i < parameters.size(); ++i)
    inputs.push_back({parameters[i]->name, DType::f32, parameters[i]->value.shape(), data[i].data()});
  io::write_safetensors(path, inputs);
}

// The values written as F64 under Tessera's names, the header and the bytes composed here.
void write_f64(const std::string& path, nn::Module& model, const std::vector<std::vector<double>>& values) {
  std::ostringstream json;
  json << "{";
  int64_t offset = 0;
  const std::vector<nn::Parameter*> parameters = model.parameters();
  for (size_t i = 0; i < parameters.size(); ++i) {
    json << (i == 0 ? "" : ",") << "\"" << parameters[i]->name << "\":{\"dtype\":\"F64\",\"shape\":[";
    const auto& sizes = parameters[i]->value.shape().sizes();
    for (size_t d = 0; d < sizes.size(); ++d) json << (d == 0 ? "" : ",") << sizes[d];
    const int64_t bytes = int64_t(values[i].size() * sizeof(double));
    json << "],\"data_offsets\":[" << offset << "," << offset + bytes << "]}";
    offset += bytes;
  }
  json << "}";
  std::string header = json.str();
  header.append((8 - header.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary);
  const uint64_t length = header.size();
  out.write(reinterpret_cast<const char*>(&length), sizeof length);
  out << header;
  for (const auto& v : values) out.write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * 8));
}

void expect_loaded(nn::Module& model, const std::vector<std::vector<double>>& values) {
  const std::vector<nn::Parameter*> parameters = model.parameters();
  for (size_t i = 0; i < parameters.size(); ++i)
    EXPECT_EQ(parameters[i]->value.to_vector<float>(), as_floats(values[i])) << parameters[i]->name;
}

TEST_F(SafetensorsWeights, ADirectoryMeansItsModelSafetensors) {
  TESSERA_SEED_TRACE();
  const auto values = random_values(*model, rng);
  fs::create_directories(dir.path() / "hf");
  write_f32(dir.file("hf/model.safetensors"), *model, values);
  EXPECT_EQ(load(dir.file("hf")).tensors, int64_t(parameters().size()));
  expect_loaded(*model, values);

  // A directory without one: the message names the safetensors files it holds.
  fs::create_directories(dir.path() / "other");
  write_f32(dir.file("other/weights.safetensors"), *model, values);
  const std::string error = error_of([&] { load(dir.file("other")); });
  EXPECT_CONTAINS(error, "--init-from " + dir.file("other") + " is a directory without a model.safetensors");
  EXPECT_CONTAINS(error, dir.file("other/weights.safetensors"));
}

TEST_F(SafetensorsWeights, AFileCutShortIsCalledTruncated) {
  TESSERA_SEED_TRACE();
  const std::string path = dir.file("model.safetensors");
  write_f32(path, *model, random_values(*model, rng));
  const int64_t whole = int64_t(fs::file_size(path));
  const io::SafetensorsFile intact(path);
  const int64_t data_bytes = intact.tensors().back().end;
  const int64_t cut = std::uniform_int_distribution<int64_t>(1, data_bytes)(rng);  // inside the data only
  fs::resize_file(path, uint64_t(whole - cut));
  const std::string error = error_of([&] { io::SafetensorsFile file(path); });
  EXPECT_CONTAINS(error, path + " is truncated");
  EXPECT_CONTAINS(error, "describes " + std::to_string(data_bytes) + " bytes of tensor data but only " +
                             std::to_string(data_bytes - cut) + " follow");
  EXPECT_CONTAINS(error, "it should be " + std::to_string(whole));
}

TEST_F(SafetensorsWeights, LoadsF64Tensors) {
  TESSERA_SEED_TRACE();
  const auto values = random_values(*model, rng);
  write_f64(dir.file("model.safetensors"), *model, values);
  load(dir.file("model.safetensors"));
  expect_loaded(*model, values);
}

TEST_F(SafetensorsWeights, RefusesNaNAndInfinityNamingTheTensor) {
  TESSERA_SEED_TRACE();
  for (const double bad : {std::nan(""), std::numeric_limits<double>::infinity(), 1e300}) {
    SCOPED_TRACE(bad);
    auto values = random_values(*model, rng);
    const size_t tensor = std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng);
    const size_t element = std::uniform_int_distribution<size_t>(0, values[tensor].size() - 1)(rng);
    values[tensor][element] = bad;
    // 1e300 is finite as F64 and becomes an infinity as the model's f32.
    const std::string path = dir.file("model.safetensors");
    if (bad == 1e300)
      write_f64(path, *model, values);
    else
      write_f32(path, *model, values);
    const std::string error = error_of([&] { load(path); });
    EXPECT_CONTAINS(error, "tensor '" + parameters()[tensor]->name + "' holds 1 value that is not finite as f32");
    EXPECT_CONTAINS(error, "(element " + std::to_string(element) + " is ");
  }
}

}  // namespace
}  // namespace tessera::testing
