// Hugging Face Llama directories in and out (io/hf_llama.h,
// io/safetensors_directory.h) without Python: every parameter kind read at
// tp 1, 2 and 4 from Hugging Face's tensors (F32, BF16, F16, F64; one file
// and shards) equals the same rank's slice of the logical tensor the test
// builds by placing the heads' rows itself; a rank reads little more than
// its slice (the process's read bytes); a directory write_hf_llama shards
// with a tiny limit, read by a reader written here (header and index by
// nlohmann::json) and read back; the shard plan of huggingface_hub; sizes as
// transformers spells them; config.json parsed, written and refused key by
// key; and every malformed directory refused naming the file, the tensor and
// the fix. tests/io/test_hf_llama_transformers.cpp checks the same against
// transformers itself.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/context.h"
#include "io/export.h"
#include "io/hf_llama.h"
#include "io/model_weights.h"
#include "io/safetensors_directory.h"
#include "io/tokenizer.h"
#include "parallel/local_communicator.h"
#include "tests/io/hf_llama_test_support.h"
#include "tests/io/io_test_files.h"
#include "tests/support/error_text.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// H 8, G 4 (R 2), so that tp 4 splits every kind: V 96, C 64, F 96, 2 layers.
io::HfLlamaConfig splittable_llama() {
  return tiny_llama(96, 64, 8, 4, 96, 2);
}

// Hugging Face's tensors written by hand as `stored` (F64, F32, BF16, F16), in
// state_dict order, sharded at every `per_file` tensors (0: one model.safetensors).
void write_hf_directory(const fs::path& dir, const io::HfLlamaConfig& c, const NamedTensors& hf,
                        const std::string& stored, size_t per_file = 0) {
  fs::create_directories(dir);
  const auto order = hf_llama_tensor_shapes(c);
  if (per_file == 0) {
    std::vector<HandTensor> all;
    for (const auto& [name, shape] : order) all.push_back(hand_tensor(name, hf.at(name), stored));
    write_by_hand((dir / "model.safetensors").string(), all);
    return;
  }
  const size_t files = (order.size() + per_file - 1) / per_file;
  Json weight_map = Json::object();
  for (size_t f = 0; f < files; ++f) {
    char file[64];
    std::snprintf(file, sizeof file, "model-%05zu-of-%05zu.safetensors", f + 1, files);
    std::vector<HandTensor> in_file;
    for (size_t i = f * per_file; i < std::min(order.size(), (f + 1) * per_file); ++i) {
      in_file.push_back(hand_tensor(order[i].first, hf.at(order[i].first), stored));
      weight_map[order[i].first] = file;
    }
    write_by_hand((dir / file).string(), in_file);
  }
  std::ofstream(dir / "model.safetensors.index.json")
      << Json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump(2);
}

// Loads rank `rank` of `ranks` and compares every parameter with its expected slice, exactly.
void expect_rank_loads(Context& ctx, const fs::path& dir, const io::HfLlamaConfig& c, const NamedTensors& logical,
                       int rank, int ranks, DType dtype, bool through_f32 = false) {
  SCOPED_TRACE("rank " + std::to_string(rank) + " of " + std::to_string(ranks) + ", " + std::string(dtype_name(dtype)));
  DesignParameters parameters = design_parameters(ctx, c, rank, ranks, dtype);
  const io::WeightsLoaded loaded = io::load_hf_llama_weights(dir.string(), parameters.pointers(), c);
  EXPECT_EQ(loaded.naming, "hf-llama");
  EXPECT_EQ(loaded.tensors, int64_t(parameters.owned.size()));
  EXPECT_EQ(loaded.ignored, 0);
  for (const auto& p : parameters.owned) {
    std::vector<double> expected = expected_slice(p->name, logical.at(p->name), rank, ranks);
    if (through_f32) expected = round_to(DType::f32, std::move(expected));  // F64 files are narrowed to f32 first
    EXPECT_TRUE(all_close(p->value, round_to(dtype, std::move(expected)), Tolerance{0, 0})) << p->name;
  }
}

TEST(HfLlamaWeights, EveryParameterKindAtTp2And4IsItsSliceOfTheHeadsPlacedByTheTest) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  Context ctx;
  TempDir dir;
  const io::HfLlamaConfig c = splittable_llama();
  for (const std::string stored : {"F32", "BF16", "F16", "F64"}) {
    SCOPED_TRACE(stored);
    const DType rounding = stored == "BF16" ? DType::bf16 : stored == "F16" ? DType::f16 : DType::f32;
    NamedTensors hf = random_tensors(hf_llama_tensor_shapes(c), rounding, rng);
    if (stored == "F64")  // values f32 cannot hold exactly
      for (auto& [name, t] : hf)
        for (double& v : t.values) v += 1e-12 * v;
    const NamedTensors logical = logical_from_hf(c, hf);
    for (const size_t per_file : {size_t(0), size_t(4)}) {
      SCOPED_TRACE(per_file == 0 ? "model.safetensors" : "shards");
      const fs::path where = dir.path() / (stored + std::to_string(per_file));
      write_hf_directory(where, c, hf, stored, per_file);
      for (const int ranks : {1, 2, 4})
        for (int rank = 0; rank < ranks; ++rank)
          for (const DType dtype : {DType::f32, DType::bf16})
            expect_rank_loads(ctx, where, c, logical, rank, ranks, dtype, stored == "F64");
    }
  }
}

// Bytes this process has read from files so far (/proc/self/io: rchar).
int64_t bytes_read() {
  std::ifstream in("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (in >> key >> value)
    if (key == "rchar:") return value;
  return -1;
}

TEST(HfLlamaWeights, ARankReadsItsSlicesNotTheWholeTensor) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  Context ctx;
  TempDir dir;
  io::HfLlamaConfig c = tiny_llama(8192, 64, 8, 4, 96, 1);  // the embedding and the head: 2 MiB each in F32
  const NamedTensors hf = random_tensors(hf_llama_tensor_shapes(c), DType::f32, rng);
  write_hf_directory(dir.path(), c, hf, "F32");
  const NamedTensors logical = logical_from_hf(c, hf);
  const int ranks = 4;
  for (int rank = 0; rank < ranks; ++rank) {
    std::vector<std::unique_ptr<nn::Parameter>> owned;
    owned.push_back(design_parameter(ctx, c, "wte.weight", logical.at("wte.weight").shape, rank, ranks, DType::f32));
    owned.push_back(
        design_parameter(ctx, c, "lm_head.weight", logical.at("lm_head.weight").shape, rank, ranks, DType::f32));
    const int64_t before = bytes_read();
    io::load_hf_llama_weights(dir.path().string(), {owned[0].get(), owned[1].get()}, c);
    const int64_t read = bytes_read() - before;
    const int64_t slices = 2 * 8192 * 64 * 4 / ranks, whole = 2 * 8192 * 64 * 4;
    EXPECT_GE(read, slices) << "rank " << rank;
    EXPECT_LT(read, slices + whole / 8) << "rank " << rank << " read " << read << " bytes for slices of " << slices;
    for (const auto& p : owned)
      EXPECT_TRUE(all_close(p->value, expected_slice(p->name, logical.at(p->name), rank, ranks), Tolerance{0, 0}));
  }
}

TEST(HfLlamaWeights, TesseraNamedWeightsAreReadBySlicesToo) {
  // load_safetensors_weights (GPT checkpoints' --init-from) shares the reader: a rank of 4 reads a quarter.
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  Context ctx;
  TempDir dir;
  const io::HfLlamaConfig c = tiny_llama(8192, 64, 8, 4, 96, 1);
  const NamedTensors tensors = random_tensors({{"wte.weight", Shape{8192, 64}}}, DType::f32, rng);
  write_by_hand(dir.file("model.safetensors"), {hand_tensor("wte.weight", tensors.at("wte.weight"), "F32")});
  for (int rank = 0; rank < 4; ++rank) {
    auto p = design_parameter(ctx, c, "wte.weight", Shape{8192, 64}, rank, 4, DType::f32);
    const int64_t before = bytes_read();
    io::load_safetensors_weights(dir.path().string(), {p.get()}, 1);
    EXPECT_LT(bytes_read() - before, 8192 * 64 * 4 / 2) << "rank " << rank;
    EXPECT_TRUE(all_close(p->value, expected_slice("wte.weight", tensors.at("wte.weight"), rank, 4), Tolerance{0, 0}));
  }
}

// Random logical tensors of `c` in `dtype`, as the writer takes them.
struct LogicalWeights {
  NamedTensors tensors;
  std::vector<std::string> storage;
  std::vector<io::SafetensorsInput> inputs;
};
LogicalWeights random_logical(const io::HfLlamaConfig& c, DType dtype, std::mt19937_64& rng) {
  LogicalWeights out;
  out.tensors = random_tensors(tessera_llama_shapes(c), dtype, rng);
  out.inputs = as_inputs(out.tensors, dtype, out.storage, tessera_llama_shapes(c));
  return out;
}

TEST(HfLlamaDirectory, ShardsWrittenWithATinyLimitReadByAReaderOfItsOwnAndLoadedBack) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  Context ctx;
  TempDir dir;
  const io::HfLlamaConfig c = splittable_llama();
  for (const DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const LogicalWeights logical = random_logical(c, dtype, rng);
    const NamedTensors hf = hf_from_logical(c, logical.tensors);
    const int64_t limit = 40000;  // bytes: a 96 × 64 F32 matrix is 24576
    const fs::path out = dir.path() / std::string(dtype_name(dtype));
    const io::HfLlamaWritten written = io::write_hf_llama(out.string(), logical.inputs, c, nullptr, limit);

    // The index, read here: every tensor once, in files named as transformers names them.
    const Json index = Json::parse(std::ifstream(out / "model.safetensors.index.json"));
    const auto order = hf_llama_tensor_shapes(c);
    ASSERT_EQ(index["weight_map"].size(), order.size());
    std::set<std::string> files;
    for (const auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
    ASSERT_GT(files.size(), 2u);
    int64_t total = 0, number = 0;
    std::string previous_file;
    for (const auto& [name, shape] : order) {
      const std::string file = index["weight_map"][name];
      // In state_dict order the files only ever advance by one (no big tensor: the limit holds each).
      if (file != previous_file) ++number;
      char expected[64];
      std::snprintf(expected, sizeof expected, "model-%05lld-of-%05zu.safetensors", static_cast<long long>(number),
                    files.size());
      EXPECT_EQ(file, expected) << name;
      previous_file = file;
      total += shape.numel() * int64_t(dtype_size(dtype));
    }
    EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), total);
    EXPECT_EQ(written.weights.files.size(), files.size() + 1);

    // Every shard, read here: format pt, the limit kept, each tensor's values and dtype.
    for (const std::string& file : files) {
      const HandFile shard = read_by_hand((out / file).string());
      EXPECT_EQ(shard.header["__metadata__"], (Json{{"format", "pt"}})) << file;
      int64_t bytes = 0;
      for (const auto& [name, tensor] : shard.tensors) {
        EXPECT_EQ(index["weight_map"][name], file) << name;
        EXPECT_EQ(shard.dtypes.at(name), stored_name(dtype)) << name;
        EXPECT_EQ(tensor.shape, hf.at(name).shape) << name;
        EXPECT_EQ(tensor.values, hf.at(name).values) << name;
        bytes += tensor.shape.numel() * int64_t(dtype_size(dtype));
      }
      EXPECT_LE(bytes, limit) << file;
    }
    // config.json, read here.
    const Json config = Json::parse(std::ifstream(out / "config.json"));
    EXPECT_EQ(config["architectures"], Json::array({"LlamaForCausalLM"}));
    EXPECT_EQ(config["torch_dtype"], dtype == DType::bf16 ? "bfloat16" : "float32");
    EXPECT_EQ(config["num_key_value_heads"], c.num_key_value_heads);
    EXPECT_FALSE(fs::exists(out / "vocab.json"));  // no tokenizer given

    for (const int ranks : {1, 2, 4})
      for (int rank = 0; rank < ranks; ++rank) expect_rank_loads(ctx, out, c, logical.tensors, rank, ranks, dtype);
  }
}

TEST(HfLlamaDirectory, BelowTheLimitOneModelSafetensorsAndNoIndex) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  TempDir dir;
  io::HfLlamaConfig c = splittable_llama();
  c.tie_word_embeddings = true;
  const LogicalWeights logical = random_logical(c, DType::f32, rng);
  const io::HfLlamaWritten written = io::write_hf_llama(dir.file("out"), logical.inputs, c, nullptr);
  EXPECT_EQ(written.weights.files, std::vector<std::string>{dir.file("out/model.safetensors")});
  EXPECT_FALSE(fs::exists(dir.path() / "out" / "model.safetensors.index.json"));
  const HandFile file = read_by_hand(dir.file("out/model.safetensors"));
  const NamedTensors hf = hf_from_logical(c, logical.tensors);
  std::vector<std::string> expected_order;
  for (const auto& [name, shape] : hf_llama_tensor_shapes(c)) expected_order.push_back(name);
  EXPECT_EQ(file.data_order, expected_order);  // state_dict order, no lm_head (tied)
  for (const auto& [name, tensor] : file.tensors) EXPECT_EQ(tensor.values, hf.at(name).values) << name;
  EXPECT_EQ(Json::parse(std::ifstream(dir.path() / "out" / "config.json"))["tie_word_embeddings"], true);
}

TEST(HfLlamaDirectory, ShardPlanIsHuggingFaceHubs) {
  // split_state_dict_into_shards_factory's docstring: sizes [6, 6, 2, 6, 2, 2] under 10 → [6], [6+2], [6+2+2];
  // a tensor above the limit gets a shard of its own when met, the open shard goes on.
  const io::ShardPlan plan = io::plan_shards({6, 6, 2, 6, 2, 2}, 10);
  EXPECT_EQ(plan.file_of, (std::vector<int>{0, 1, 1, 2, 2, 2}));
  EXPECT_EQ(plan.files,
            (std::vector<std::string>{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                      "model-00003-of-00003.safetensors"}));
  const io::ShardPlan big = io::plan_shards({3, 20, 3, 9}, 10);
  EXPECT_EQ(big.file_of, (std::vector<int>{1, 0, 1, 2}));
  EXPECT_EQ(io::plan_shards({3, 3}, 10).files, std::vector<std::string>{"model.safetensors"});
  EXPECT_EQ(io::plan_shards({30}, 10).files, std::vector<std::string>{"model.safetensors"});
}

TEST(HfLlamaDirectory, ShardSizesAsTransformersSpellsThem) {
  EXPECT_EQ(io::parse_shard_size("5GB"), int64_t(5) * 1000 * 1000 * 1000);
  EXPECT_EQ(io::parse_shard_size("500MB"), int64_t(500) * 1000 * 1000);
  EXPECT_EQ(io::parse_shard_size("10KB"), 10000);
  EXPECT_EQ(io::parse_shard_size("10kb"), 10000);
  EXPECT_EQ(io::parse_shard_size("1.5GB"), int64_t(1500) * 1000 * 1000);
  EXPECT_EQ(io::parse_shard_size("2GiB"), int64_t(2) << 30);
  EXPECT_EQ(io::parse_shard_size("512MiB"), int64_t(512) << 20);
  EXPECT_EQ(io::parse_shard_size("64KiB"), 65536);
  EXPECT_EQ(io::parse_shard_size("12345"), 12345);
  for (const std::string bad : {"", "GB", "5XB", "-5GB", "0", "5 GB", "1e3MB", "0.1B"}) {
    const std::string error = error_of([&] { io::parse_shard_size(bad, "--max-shard-size"); });
    EXPECT_CONTAINS(error, "--max-shard-size " + bad);
  }
}

// ---- malformed directories ----

class HfLlamaMalformed : public ::testing::Test {
 protected:
  HfLlamaMalformed() : c(splittable_llama()) {
    hf = random_tensors(hf_llama_tensor_shapes(c), DType::f32, rng);
    write_hf_directory(dir.path() / "m", c, hf, "F32", 4);
  }
  std::string load(DType dtype = DType::f32) {
    DesignParameters parameters = design_parameters(ctx, c, 1, 2, dtype);
    return error_of([&] { io::load_hf_llama_weights(where(), parameters.pointers(), c); });
  }
  std::string where() const { return (dir.path() / "m").string(); }
  std::string path(const std::string& file) const { return (dir.path() / "m" / file).string(); }
  Json index() const { return Json::parse(std::ifstream(path("model.safetensors.index.json"))); }
  void write_index(const Json& content) const {
    std::ofstream(path("model.safetensors.index.json")) << content.dump(2);
  }
  std::string shard_of(const std::string& tensor) const { return index()["weight_map"][tensor]; }
  // The tensors the index puts in `file`, as F32 by hand.
  std::vector<HandTensor> tensors_in(const std::string& file) const {
    const Json map = index()["weight_map"];
    std::vector<HandTensor> tensors;
    for (const auto& [name, in] : map.items())
      if (in == file) tensors.push_back(hand_tensor(name, hf.at(name), "F32"));
    return tensors;
  }

  std::mt19937_64 rng = make_rng();
  Context ctx;
  TempDir dir;
  io::HfLlamaConfig c;
  NamedTensors hf;
};

TEST_F(HfLlamaMalformed, AMissingShardIsNamedWithTheIndexAndATensorItHolds) {
  const std::string tensor = "model.layers.1.mlp.up_proj.weight", file = shard_of(tensor);
  fs::remove(path(file));
  const std::string error = load();
  EXPECT_CONTAINS(error, path("model.safetensors.index.json"));
  EXPECT_CONTAINS(error, "to " + file + ", but " + path(file) + " is missing");
  EXPECT_CONTAINS(error, "copy or download every shard the index names");
}

TEST_F(HfLlamaMalformed, AnIndexNamingAFileThatIsNotThereIsRefused) {
  Json content = index();
  content["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors";
  write_index(content);
  const std::string error = load();
  EXPECT_CONTAINS(error, "(model.norm.weight) to model-00099-of-00099.safetensors, but " +
                             path("model-00099-of-00099.safetensors") + " is missing");
  content["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors";
  write_index(content);
  EXPECT_CONTAINS(load(),
                  "maps tensor model.norm.weight to '../elsewhere.safetensors', which is not the name of a file");
}

TEST_F(HfLlamaMalformed, ATensorAbsentFromTheShardItsIndexNamesIsRefused) {
  const std::string tensor = "model.layers.0.self_attn.k_proj.weight", other = shard_of("model.norm.weight");
  ASSERT_NE(shard_of(tensor), other);
  Json content = index();
  content["weight_map"][tensor] = other;
  write_index(content);
  const std::string error = load();
  EXPECT_CONTAINS(error,
                  "maps tensor " + tensor + " to " + other + ", but " + path(other) + " has no tensor " + tensor);
  EXPECT_CONTAINS(error, "the index and the shards do not belong together");
}

TEST_F(HfLlamaMalformed, ATensorInTwoShardsIsRefusedNamingBoth) {
  const std::string tensor = "model.embed_tokens.weight", first = shard_of(tensor), last = shard_of("lm_head.weight");
  // The last shard written again with the embedding in it as well.
  std::vector<HandTensor> tensors = tensors_in(last);
  tensors.push_back(hand_tensor(tensor, hf.at(tensor), "F32"));
  write_by_hand(path(last), tensors);
  const std::string error = load();
  EXPECT_CONTAINS(error, "tensor " + tensor + " is in two shards of " + where());
  EXPECT_CONTAINS(error, path(first));
  EXPECT_CONTAINS(error, path(last));
}

TEST_F(HfLlamaMalformed, AShapeThatDisagreesWithTheModelNamesBothShapes) {
  // The file's k_proj holds the same number of elements under another shape.
  const std::string tensor = "model.layers.1.self_attn.k_proj.weight", file = shard_of(tensor);
  std::vector<HandTensor> tensors = tensors_in(file);
  for (HandTensor& t : tensors)
    if (t.name == tensor) t.shape = {t.shape[0] / 2, t.shape[1] * 2};
  write_by_hand(path(file), tensors);
  const std::string error = load();
  EXPECT_CONTAINS(error, path(file) + ": tensor '" + tensor +
                             "' is [16, 128] but the model's blocks.1.attn.qkv.weight needs [32, 64]");
}

TEST_F(HfLlamaMalformed, AnUnknownOrIntegerDtypeIsNamedWithTheTensor) {
  const std::string tensor = "model.norm.weight", file = shard_of(tensor);
  for (const std::string dtype : {"F8_E5M2", "I32"}) {
    SCOPED_TRACE(dtype);
    std::vector<HandTensor> tensors = tensors_in(file);
    for (HandTensor& t : tensors)
      if (t.name == tensor) {
        t.dtype = dtype;
        if (dtype == "F8_E5M2") t.bytes.resize(t.bytes.size() / 4);
      }
    write_by_hand(path(file), tensors);
    const std::string error = load();
    EXPECT_CONTAINS(error, path(file));
    EXPECT_CONTAINS(error, tensor);
    EXPECT_CONTAINS(error, dtype == "I32" ? "holds i32, not floating-point weights"
                                          : "has dtype \"F8_E5M2\", which Tessera does not read");
    EXPECT_CONTAINS(error, dtype == "I32" ? "save it as float32, bfloat16 or float16" : "convert it first");
  }
}

TEST_F(HfLlamaMalformed, AMissingTensorAndAMalformedIndexAreNamed) {
  Json content = index();
  content["weight_map"].erase("model.layers.0.mlp.down_proj.weight");
  write_index(content);
  EXPECT_CONTAINS(
      load(), "has no tensor 'model.layers.0.mlp.down_proj.weight' for the model's parameter blocks.0.mlp.proj.weight");

  std::ofstream(path("model.safetensors.index.json")) << "{\"weight_map\": {";
  EXPECT_CONTAINS(load(), path("model.safetensors.index.json") + " is not a JSON object");
  write_index(Json{{"metadata", {}}});
  EXPECT_CONTAINS(load(), "has no object \"weight_map\"");

  fs::remove(path("model.safetensors.index.json"));
  const std::string error = load();
  EXPECT_CONTAINS(
      error, "--init-from " + where() + " is a directory without a model.safetensors or model.safetensors.index.json");
  EXPECT_CONTAINS(error, path("model-00001-of-00006.safetensors"));
}

TEST_F(HfLlamaMalformed, ANonFiniteValueInTheRanksSliceNamesTheTensorAndElement) {
  // Rank 1 of 2 owns k head 2..3 of layer 0: element (row 2·Dh, column 5) of k_proj is in its slice.
  const std::string tensor = "model.layers.0.self_attn.k_proj.weight", file = shard_of(tensor);
  const int64_t element = 2 * 8 * 64 + 5;
  hf[tensor].values[size_t(element)] = std::nan("");
  write_by_hand(path(file), tensors_in(file));
  const std::string error = load();
  EXPECT_CONTAINS(error, path(file) + ": tensor '" + tensor + "' holds 1 value that is not finite as f32 (element " +
                             std::to_string(element) + " is nan)");
  // Rank 0 does not own it, and loads.
  DesignParameters rank0 = design_parameters(ctx, c, 0, 2, DType::f32);
  EXPECT_EQ(error_of([&] { io::load_hf_llama_weights(where(), rank0.pointers(), c); }), "(no error)");
}

// ---- config.json ----

Json llama_config_json() {
  return Json{{"architectures", {"LlamaForCausalLM"}},
              {"model_type", "llama"},
              {"vocab_size", 96},
              {"hidden_size", 64},
              {"intermediate_size", 160},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"rms_norm_eps", 1e-5},
              {"rope_theta", 500000.0},
              {"max_position_embeddings", 64},
              {"tie_word_embeddings", false},
              {"attention_bias", false},
              {"mlp_bias", false},
              {"hidden_act", "silu"},
              {"rope_scaling", nullptr},
              {"head_dim", 16},
              {"torch_dtype", "bfloat16"},
              {"bos_token_id", 1},
              {"eos_token_id", 2}};
}

TEST(HfLlamaConfig, ParsesWritesAndParsesBack) {
  const io::HfLlamaConfig c = io::parse_hf_llama_config(llama_config_json().dump(), "config.json");
  expect_same_llama(c, tiny_llama(96, 64, 4, 2, 160, 2));  // llama_config_json()'s values
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_id, 2);
  EXPECT_EQ(c.head_dim(), 16);
  EXPECT_EQ(c.queries_per_group(), 2);

  const Json written = Json::parse(io::hf_llama_config_json(c));
  const Json given = llama_config_json();
  for (const auto& [key, value] : given.items()) EXPECT_EQ(written[key], value) << key;
  const io::HfLlamaConfig again = io::parse_hf_llama_config(written.dump(), "written");
  EXPECT_EQ(again.rope_theta, c.rope_theta);
  EXPECT_EQ(again.num_key_value_heads, c.num_key_value_heads);

  // LlamaConfig's defaults for what a file leaves out; no token ids written as null.
  Json minimal = llama_config_json();
  for (const char* key : {"num_key_value_heads", "rope_theta", "tie_word_embeddings", "rms_norm_eps",
                          "max_position_embeddings", "bos_token_id", "eos_token_id", "head_dim", "architectures"})
    minimal.erase(key);
  const io::HfLlamaConfig defaults = io::parse_hf_llama_config(minimal.dump(), "minimal");
  EXPECT_EQ(defaults.num_key_value_heads, 4);
  EXPECT_EQ(defaults.rope_theta, 10000.0);
  EXPECT_FALSE(defaults.tie_word_embeddings);
  EXPECT_EQ(defaults.rms_norm_eps, 1e-6);
  EXPECT_EQ(defaults.max_position_embeddings, 2048);
  const Json no_tokens = Json::parse(io::hf_llama_config_json(defaults));
  EXPECT_TRUE(no_tokens["bos_token_id"].is_null() && no_tokens["eos_token_id"].is_null());
}

TEST(HfLlamaConfig, ReadsTheFileOfADirectory) {
  TempDir dir;
  std::ofstream(dir.file("config.json")) << llama_config_json().dump(2);
  EXPECT_EQ(io::read_hf_llama_config(dir.path().string()).num_key_value_heads, 2);
  EXPECT_EQ(io::read_hf_llama_config(dir.file("config.json")).num_key_value_heads, 2);
  EXPECT_CONTAINS(error_of([&] { io::read_hf_llama_config(dir.file("none")); }), "cannot open " + dir.file("none"));
}

TEST(HfLlamaConfig, EachBadKeyIsRefusedByName) {
  struct Case {
    const char* key;
    Json value;  // null: the key removed
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"hidden_size", nullptr, "\"hidden_size\" is missing"},
      {"vocab_size", nullptr, "\"vocab_size\" is missing"},
      {"intermediate_size", nullptr, "\"intermediate_size\" is missing"},
      {"num_hidden_layers", nullptr, "\"num_hidden_layers\" is missing"},
      {"num_attention_heads", nullptr, "\"num_attention_heads\" is missing"},
      {"vocab_size", "96", "\"vocab_size\" is \"96\", not a positive integer"},
      {"hidden_size", -64, "\"hidden_size\" is -64, not a positive integer"},
      {"num_hidden_layers", int64_t(1) << 40, "\"num_hidden_layers\" is 1099511627776; it must be in [1, 65536]"},
      {"num_key_value_heads", 8, "\"num_key_value_heads\" is 8; it must be in [1, 4]"},
      {"num_key_value_heads", 3, "\"num_attention_heads\" 4 is not divisible by \"num_key_value_heads\" 3"},
      {"num_attention_heads", 3, "\"hidden_size\" 64 is not divisible by \"num_attention_heads\" 3"},
      {"attention_bias", true, "\"attention_bias\" is true, but Tessera's Llama has no biases"},
      {"mlp_bias", true, "\"mlp_bias\" is true, but Tessera's Llama has no biases"},
      {"rope_scaling", Json{{"rope_type", "llama3"}, {"factor", 8.0}},
       "\"rope_scaling\" is {\"factor\":8.0,\"rope_type\":\"llama3\"}: RoPE scaling"},
      {"head_dim", 32, "\"head_dim\" is 32 but hidden_size / num_attention_heads is 16"},
      {"model_type", "mistral", "\"model_type\" is \"mistral\", not \"llama\""},
      {"model_type", nullptr, "\"model_type\" is missing, not \"llama\""},
      {"architectures", Json::array({"MistralForCausalLM"}),
       "\"architectures\" is [\"MistralForCausalLM\"], without \"LlamaForCausalLM\""},
      {"hidden_act", "gelu", "\"hidden_act\" is \"gelu\", but Tessera's Llama uses SwiGLU"},
      {"rms_norm_eps", "small", "\"rms_norm_eps\" is \"small\", not a positive number"},
      {"rope_theta", 0, "\"rope_theta\" is 0, not a positive number"},
      {"tie_word_embeddings", "no", "\"tie_word_embeddings\" is \"no\", not true or false"},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.key);
    Json config = llama_config_json();
    if (bad.value.is_null())
      config.erase(bad.key);
    else
      config[bad.key] = bad.value;
    const std::string error = error_of([&] { io::parse_hf_llama_config(config.dump(), "dir/config.json"); });
    EXPECT_CONTAINS(error, "dir/config.json: " + bad.expected);
  }
  EXPECT_CONTAINS(error_of([&] { io::parse_hf_llama_config("{\"model_type\": \"llama\",", "dir/config.json"); }),
                  "dir/config.json is not a JSON object (malformed JSON)");
  EXPECT_CONTAINS(error_of([&] { io::parse_hf_llama_config("[1, 2]", "dir/config.json"); }),
                  "dir/config.json is not a JSON object");
}

// A Mixtral's config.json: its experts read (the model gets them in every
// block, of intermediate_size's width), written back the same, and its
// refusals named.
TEST(HfLlamaConfig, MixtralsExpertsAreReadWrittenAndChecked) {
  Json config = llama_config_json();
  config["model_type"] = "mixtral";
  config["architectures"] = Json::array({"MixtralForCausalLM"});
  config["num_local_experts"] = 8;
  config["num_experts_per_tok"] = 2;
  config["router_aux_loss_coef"] = 0.02;
  config["sliding_window"] = nullptr;
  const io::HfLlamaConfig c = io::parse_hf_llama_config(config.dump(), "dir/config.json");
  EXPECT_TRUE(c.mixtral());
  EXPECT_EQ(c.num_local_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  const nn::ModelConfig m = io::llama_model_config(c, 32);
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.moe_router_topk, 2);
  EXPECT_EQ(m.moe_ffn(), config["intermediate_size"].get<int64_t>());
  for (int64_t layer = 0; layer < m.num_layers; ++layer) EXPECT_TRUE(m.moe_layer(layer));
  const io::HfLlamaConfig again = io::parse_hf_llama_config(io::hf_llama_config_json(c), "written");
  EXPECT_EQ(again.num_local_experts, 8);
  EXPECT_EQ(again.num_experts_per_tok, 2);
  EXPECT_EQ(again.router_aux_loss_coef, 0.02);
  EXPECT_EQ(Json::parse(io::hf_llama_config_json(c))["architectures"], Json::array({"MixtralForCausalLM"}));
  // The layouts: a router and three matrices per expert instead of the dense MLP's.
  int routers = 0, experts = 0, dense = 0;
  for (const io::ParameterInFile& layout : io::hf_llama_layouts(c)) {
    routers += layout.parameter.find("mlp.router.weight") != std::string::npos;
    experts += layout.parameter.find("mlp.experts.") != std::string::npos;
    dense += layout.parameter.find("mlp.fc.weight") != std::string::npos &&
             layout.parameter.find("experts") == std::string::npos;
  }
  EXPECT_EQ(routers, c.num_hidden_layers);
  EXPECT_EQ(experts, 2 * 8 * c.num_hidden_layers);
  EXPECT_EQ(dense, 0);

  struct Case {
    std::string key;
    Json value;
    std::string expected;
  };
  for (const Case& bad : std::vector<Case>{
           {"num_local_experts", nullptr, "\"num_local_experts\" is missing"},
           {"num_experts_per_tok", 9, "\"num_experts_per_tok\" 9 must be from 1 to \"num_local_experts\" 8"},
           {"sliding_window", 4, "\"sliding_window\" is 4: sliding-window attention"},
           {"architectures", Json::array({"LlamaForCausalLM"}),
            "\"architectures\" is [\"LlamaForCausalLM\"], without \"MixtralForCausalLM\""}}) {
    SCOPED_TRACE(bad.key);
    Json broken = config;
    if (bad.value.is_null())
      broken.erase(bad.key);
    else
      broken[bad.key] = bad.value;
    EXPECT_CONTAINS(error_of([&] { io::parse_hf_llama_config(broken.dump(), "dir/config.json"); }),
                    "dir/config.json: " + bad.expected);
  }
}

// ---- writing refusals ----

TEST(HfLlamaDirectory, WritingRefusesTensorsThatDoNotFitTheConfig) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  TempDir dir;
  const io::HfLlamaConfig c = splittable_llama();
  LogicalWeights logical = random_logical(c, DType::f32, rng);
  std::vector<io::SafetensorsInput> inputs = logical.inputs;
  inputs.erase(inputs.begin() + 2);  // blocks.0.attn.qkv.weight
  EXPECT_CONTAINS(error_of([&] { io::write_hf_llama(dir.file("a"), inputs, c, nullptr); }),
                  "no tensor blocks.0.attn.qkv.weight among the model's");
  inputs = logical.inputs;
  inputs[1].shape = Shape{32};
  EXPECT_CONTAINS(error_of([&] { io::write_hf_llama(dir.file("b"), inputs, c, nullptr); }),
                  "blocks.0.ln1.weight is [32] but config.json's sizes make it [64]");
  io::HfLlamaConfig tied = c;
  tied.tie_word_embeddings = true;
  EXPECT_CONTAINS(error_of([&] { io::write_hf_llama(dir.file("c"), logical.inputs, tied, nullptr); }),
                  "tensor lm_head.weight has no place in Hugging Face's Llama with tie_word_embeddings true");
  const io::Tokenizer bytes = io::Tokenizer::bytes();  // 256 tokens, more than the vocabulary of 96
  EXPECT_CONTAINS(error_of([&] { io::write_hf_llama(dir.file("d"), logical.inputs, c, &bytes); }),
                  "the tokenizer has 256 tokens, more than the model's vocabulary of 96");
  EXPECT_FALSE(fs::exists(dir.path() / "a"));
  EXPECT_FALSE(fs::exists(dir.path() / "d"));
}

// ---- `tessera export --format hf-llama` (through io::export_checkpoint) ----

// A checkpoint as `tessera train --model llama` would save it: the logical tensors (and an optimizer state),
// model.* metadata, the rotary base and norm epsilon among the flags.
std::string save_llama_checkpoint(const std::string& dir, const io::HfLlamaConfig& c, const NamedTensors& logical,
                                  DType dtype, const std::string& kind = "llama",
                                  const io::CheckpointMetadata& settings = {}) {
  Context ctx;
  auto world = parallel::make_local_communicator();
  std::vector<io::TensorPiece> pieces;
  for (const auto& [name, shape] : tessera_llama_shapes(c)) {
    io::TensorPiece piece;
    piece.name = name;
    piece.global_shape = shape;
    piece.dtype = dtype;
    piece.local = ctx.from_doubles(shape, dtype, logical.at(name).values, Device::cpu());
    pieces.push_back(piece);
  }
  io::TensorPiece state = pieces.front();
  state.name = "wte.weight.exp_avg";
  pieces.push_back(state);
  io::CheckpointMetadata metadata = {{"model.kind", kind},
                                     {"model.dtype", std::string(dtype_name(dtype))},
                                     {"model.vocab_size", std::to_string(c.vocab_size)},
                                     {"model.seq_length", std::to_string(c.max_position_embeddings)},
                                     {"model.num_layers", std::to_string(c.num_hidden_layers)},
                                     {"model.num_heads", std::to_string(c.num_attention_heads)},
                                     {"model.hidden_size", std::to_string(c.hidden_size)},
                                     {"model.ffn_hidden_size", std::to_string(c.intermediate_size)},
                                     {"config.rotary-base", "500000"},
                                     {"config.norm-epsilon", "1e-05"}};
  metadata.insert(settings.begin(), settings.end());
  return io::save_checkpoint(*world, dir, 2, pieces, metadata);
}

TEST(HfLlamaExport, ALlamaCheckpointBecomesADirectoryShardedAboveTheLimit) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  TempDir dir;
  const io::HfLlamaConfig c = splittable_llama();
  const NamedTensors logical = random_tensors(tessera_llama_shapes(c), DType::bf16, rng);
  const std::string checkpoint = save_llama_checkpoint(dir.file("ckpt"), c, logical, DType::bf16);
  const NamedTensors hf = hf_from_logical(c, logical);
  for (const int64_t limit : {io::kDefaultMaxShardBytes, int64_t(20000)}) {
    SCOPED_TRACE(limit);
    io::ExportOptions options;
    options.format = "hf-llama";
    options.max_shard_bytes = limit;
    const fs::path out = dir.path() / ("hf" + std::to_string(limit));
    const io::ExportResult result = io::export_checkpoint(checkpoint, out.string(), options);
    EXPECT_EQ(result.tensors, int64_t(hf.size()));
    EXPECT_CONTAINS(result.tokenizer_note, "no tokenizer written");
    const io::HfLlamaConfig written = io::read_hf_llama_config(out.string());
    expect_same_llama(written, c);  // G from the qkv rows, rope_theta and rms_norm_eps from the flags
    EXPECT_EQ(written.torch_dtype, "bfloat16");
    // Every Hugging Face tensor, read here from whichever file holds it.
    std::map<std::string, HostTensor> found;
    for (const auto& entry : fs::directory_iterator(out))
      if (entry.path().extension() == ".safetensors")
        for (const auto& [name, tensor] : read_by_hand(entry.path().string()).tensors) found[name] = tensor;
    EXPECT_EQ(found.size(), hf.size());
    for (const auto& [name, tensor] : hf) EXPECT_EQ(found[name].values, tensor.values) << name;
    EXPECT_EQ(fs::exists(out / "model.safetensors.index.json"), limit < io::kDefaultMaxShardBytes);
    EXPECT_EQ(result.shards.empty(), limit == io::kDefaultMaxShardBytes);
  }
  // Files are refused for hf-llama; other models' checkpoints are named.
  io::ExportOptions llama;
  llama.format = "hf-llama";
  EXPECT_CONTAINS(error_of([&] { io::export_checkpoint(checkpoint, dir.file("one.safetensors"), llama); }),
                  "hf-llama writes a directory");
  const std::string gpt = save_llama_checkpoint(dir.file("gpt"), c, logical, DType::bf16, "gpt");
  EXPECT_CONTAINS(error_of([&] { io::export_checkpoint(gpt, dir.file("g"), llama); }),
                  "holds a model with LayerNorm (--normalization LayerNorm), learned positions "
                  "(--position-embedding-type learned_absolute), a GELU MLP (no --swiglu), biases (no "
                  "--disable-bias-linear), which LlamaForCausalLM does not have; export it with --format ");
  io::ExportOptions gpt2;
  gpt2.format = "hf-gpt2";
  EXPECT_CONTAINS(error_of([&] { io::export_checkpoint(checkpoint, dir.file("l"), gpt2); }),
                  "holds a model with RMSNorm (--normalization RMSNorm), rotary embeddings (--position-embedding-type "
                  "rope), a SwiGLU MLP (--swiglu), no biases (--disable-bias-linear)");
  EXPECT_CONTAINS(error_of([&] { io::export_checkpoint(checkpoint, dir.file("l"), gpt2); }),
                  "which GPT2LMHeadModel does not have; export it with --format hf-llama");
  EXPECT_FALSE(fs::exists(dir.path() / "g"));
  EXPECT_FALSE(fs::exists(dir.path() / "l"));
}

// config.json's attention_dropout is the checkpoint's --attention-dropout,
// 0 for a checkpoint from before the flag.
TEST(HfLlamaExport, ConfigCarriesTheAttentionDropoutTrainedWith) {
  TESSERA_SEED_TRACE();
  std::mt19937_64 rng = make_rng();
  TempDir dir;
  const io::HfLlamaConfig c = splittable_llama();
  const NamedTensors logical = random_tensors(tessera_llama_shapes(c), DType::f32, rng);
  for (const auto& [name, settings, expected] :
       {std::tuple{"with", io::CheckpointMetadata{{"config.attention-dropout", "0.125"}}, 0.125},
        std::tuple{"before", io::CheckpointMetadata{}, 0.0}}) {
    SCOPED_TRACE(name);
    const std::string checkpoint =
        save_llama_checkpoint(dir.file(std::string("ckpt_") + name), c, logical, DType::f32, "llama", settings);
    io::ExportOptions options;
    options.format = "hf-llama";
    const fs::path out = dir.path() / (std::string("hf_") + name);
    io::export_checkpoint(checkpoint, out.string(), options);
    const Json config = Json::parse(std::ifstream(out / "config.json"));
    EXPECT_EQ(config["attention_dropout"], expected);
  }
}

}  // namespace
}  // namespace tessera::testing
