// `tessera export`: a GPT trained by `tessera train` (2 ranks, dp 1 × tp 2,
// so the checkpoint's tensors are stitched from shards) is exported with
// --format hf-gpt2; Python with the `safetensors` package and NumPy (the
// pinned tools environment scripts/install-deps.sh makes) loads the file and
// config.json, runs a GPT-2 forward written independently in the test in
// float64, and matches the logits Tessera's own model computes from the same
// checkpoint (1e-4). --format tessera keeps Tessera's names and no optimizer
// state. Where an export writes: -o DIR for hf-gpt2 is a directory (run in
// an empty working directory, whose listing afterwards holds that directory
// and nothing else), a non-empty one is refused unless --force, files beside
// a FILE.safetensors are not replaced; refusals (a tokenizer that does not
// fit, an output under a file) leave nothing behind; an output over the
// checkpoint being read is refused and the checkpoint still verifies.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/context.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "nn/models.h"
#include "models/stage_model.h"
#include "tests/support/process_job.h"
#include "tests/support/resume_support.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::seconds;

// The Python of the tools environment (safetensors and NumPy pinned there).
std::string tools_python() {
  const char* dir = std::getenv("TESSERA_TOOLS_DIR");
  return (fs::path(dir ? dir : "/opt/tessera-tools") / "bin" / "python").string();
}

// GPT-2's forward in NumPy (float64), from model.safetensors and config.json
// of argv[1]; token ids (int32 [B, T]) from argv[2]; compares the logits with
// argv[3] (float32 [B, T, V]) and prints the largest difference.
constexpr const char* kNumpyGpt2 = R"(
import json, sys
import numpy as np
from safetensors.numpy import load_file
directory, ids_path, logits_path, batch, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
config = json.load(open(directory + '/config.json'))
w = {k: v.astype(np.float64) for k, v in load_file(directory + '/model.safetensors').items()}
C, H, L = config['n_embd'], config['n_head'], config['n_layer']
eps = config['layer_norm_epsilon']
assert config['activation_function'] == 'gelu_new' and config['tie_word_embeddings']
ids = np.fromfile(ids_path, dtype=np.int32).reshape(batch, steps)
def norm(x, name):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w[name + '.weight'] + w[name + '.bias']
def gelu(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))
def conv1d(x, name):  # Hugging Face's Conv1D: x @ W[in, out] + b
    return x @ w[name + '.weight'] + w[name + '.bias']
x = w['transformer.wte.weight'][ids] + w['transformer.wpe.weight'][:steps]
D = C // H
mask = np.triu(np.ones((steps, steps), dtype=bool), 1)
for i in range(L):
    p = 'transformer.h.%d.' % i
    qkv = conv1d(norm(x, p + 'ln_1'), p + 'attn.c_attn')
    q, k, v = (qkv[..., j * C:(j + 1) * C].reshape(batch, steps, H, D).transpose(0, 2, 1, 3) for j in range(3))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)
    scores[..., mask] = -np.inf
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    attention = (scores / scores.sum(-1, keepdims=True)) @ v
    x = x + conv1d(attention.transpose(0, 2, 1, 3).reshape(batch, steps, C), p + 'attn.c_proj')
    x = x + conv1d(gelu(conv1d(norm(x, p + 'ln_2'), p + 'mlp.c_fc')), p + 'mlp.c_proj')
logits = norm(x, 'transformer.ln_f') @ w['transformer.wte.weight'].T
expected = np.fromfile(logits_path, dtype=np.float32).reshape(logits.shape)
difference = float(np.abs(logits - expected).max())
print('largest difference %.3g over %d logits (scale %.3g)' % (difference, logits.size, float(np.abs(logits).max())))
sys.exit(0 if difference < 1e-4 else 1)
)";

// The logits Tessera's GPT computes for `ids` [B, T] with the parameters of `checkpoint`.
Tensor tessera_logits(Context& ctx, const std::string& checkpoint, const nn::ModelConfig& config, const Tensor& ids) {
  nn::ModelSpec spec;
  spec.context = &ctx;
  spec.dtype = DType::f32;
  auto model = models::build_model(config, spec);
  const io::CheckpointReader reader(checkpoint);
  for (nn::Parameter* p : model->parameters()) {
    io::TensorPiece piece;
    piece.name = p->name;
    piece.global_shape = p->value.shape();
    piece.dtype = p->value.dtype();
    piece.local = p->value;
    reader.read(piece);
  }
  nn::Saved saved;
  return model->forward(ids, saved, nn::Pass{}).clone();
}

void write_raw(const std::string& path, const Tensor& tensor) {
  std::ofstream(path, std::ios::binary)
      .write(static_cast<const char*>(tensor.data_ptr()), std::streamsize(tensor.nbytes()));
}

TEST(Export, HfGpt2LoadsInNumpyAndMatchesTesserasLogits) {
  TESSERA_SEED_TRACE();
  if (!fs::exists(tools_python()))
    GTEST_SKIP() << tools_python() << " is missing: run scripts/install-deps.sh (it pins safetensors and NumPy there)";
  ScratchDirectory dir("tessera_export_");
  std::mt19937_64 rng = make_rng();
  nn::ModelConfig config;
  config.kind = nn::ModelKind::gpt;
  config.vocab_size = 64;
  config.seq_length = 16;
  config.num_layers = 2;
  config.num_heads = 2;
  config.hidden_size = 32;
  const std::string train = run_training(
      2,
      words("--model gpt --synthetic --vocab-size 64 --seq-length 16 --num-layers 2 --num-heads 2 --hidden-size 32 "
            "--micro-batch-size 4 --tp 2 --train-steps 3 --lr 1e-2 --threads 1 --seed " +
            std::to_string(rng() % 1000) + " --save " + (dir / "ckpt")),
      dir / "train.log");
  const std::string checkpoint = dir / "ckpt/step_00000003";

  fs::create_directories(dir / "hf");
  const Outcome exported =
      run_command({TESSERA_BINARY, "export", dir / "ckpt", "-o", dir / "hf/model.safetensors", "--format", "hf-gpt2"},
                  dir / "export.log", seconds(60));
  ASSERT_EQ(exported.status, 0) << exported.output;
  EXPECT_TRUE(contains(exported.output, "wrote " + (dir / "hf/model.safetensors") + ": 28 tensors")) << exported.output;
  EXPECT_TRUE(fs::exists(dir / "hf/config.json"));
  const io::SafetensorsFile file(dir / "hf/model.safetensors");  // Tessera's reader agrees on the layout
  ASSERT_NE(file.find("transformer.h.1.attn.c_attn.weight"), nullptr);
  EXPECT_EQ(file.find("transformer.h.1.attn.c_attn.weight")->shape, Shape({32, 96}));
  EXPECT_EQ(file.find("transformer.h.0.mlp.c_proj.weight")->shape, Shape({128, 32}));

  Context ctx;
  const int64_t batch = 3, steps = 16;
  std::vector<int32_t> ids(size_t(batch * steps));
  for (int32_t& id : ids) id = int32_t(rng() % 64);
  const Tensor ids_tensor = ctx.from_vector(Shape{batch, steps}, ids);
  write_raw(dir / "ids.bin", ids_tensor);
  write_raw(dir / "logits.bin", tessera_logits(ctx, checkpoint, config, ids_tensor));
  const Outcome numpy = run_command({tools_python(), "-c", kNumpyGpt2, dir / "hf", dir / "ids.bin", dir / "logits.bin",
                                     std::to_string(batch), std::to_string(steps)},
                                    dir / "numpy.log", seconds(120));
  EXPECT_EQ(numpy.status, 0) << numpy.output;
  EXPECT_TRUE(contains(numpy.output, "largest difference")) << numpy.output;
  std::printf("numpy: %s", numpy.output.c_str());

  // --format tessera: Tessera's names, parameters only, the model in the metadata.
  const Outcome plain = run_command({TESSERA_BINARY, "export", checkpoint, "-o", dir / "tessera.safetensors"},
                                    dir / "plain.log", seconds(60));
  ASSERT_EQ(plain.status, 0) << plain.output;
  const io::SafetensorsFile tessera(dir / "tessera.safetensors");
  EXPECT_EQ(tessera.tensors().size(), 28u);
  EXPECT_NE(tessera.find("blocks.0.attn.qkv.weight"), nullptr);
  EXPECT_EQ(tessera.find("blocks.0.attn.qkv.weight.exp_avg"), nullptr);
  EXPECT_EQ(tessera.metadata().at("tessera.model.kind"), "gpt");
}

// A small GPT trained for 2 steps on one rank and saved under `dir`/ckpt: the checkpoint to export.
std::string small_checkpoint(const ScratchDirectory& dir, const std::string& extra = "") {
  run_training(1,
               words("--model gpt --synthetic --vocab-size 64 --seq-length 16 --num-layers 2 --num-heads 2 "
                     "--hidden-size 32 --micro-batch-size 4 --train-steps 2 --threads 1 --save " +
                     (dir / "ckpt") + " " + extra),
               dir / "train.log");
  return dir / "ckpt";
}

// `argv` run with `directory` as its working directory.
std::vector<std::string> in_directory(const std::string& directory, const std::vector<std::string>& argv) {
  return joined({"/bin/sh", "-c", "cd \"$0\" && exec \"$@\"", directory}, argv);
}

Outcome export_in(const ScratchDirectory& dir, const std::string& directory, const std::vector<std::string>& args) {
  return run_command(in_directory(directory, joined({TESSERA_BINARY, "export"}, args)), dir / "export.log",
                     seconds(60));
}

// Every entry under `dir` (directories end in '/') with a file's bytes.
std::map<std::string, std::string> listing(const fs::path& dir) {
  std::map<std::string, std::string> entries;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    const std::string name = fs::relative(entry.path(), dir).string();
    if (entry.is_directory()) {
      entries[name + "/"] = "";
      continue;
    }
    std::ifstream in(entry.path(), std::ios::binary);
    entries[name] = std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return entries;
}

std::vector<std::string> names_of(const std::map<std::string, std::string>& entries) {
  std::vector<std::string> names;
  for (const auto& [name, bytes] : entries) names.push_back(name);
  return names;
}

TEST(Export, HfGpt2WritesTheDirectoryItIsGivenAndNothingElse) {
  ScratchDirectory dir("tessera_export_dir_");
  const std::string checkpoint = small_checkpoint(dir);
  const std::string work = dir / "work";
  fs::create_directories(work);
  const Outcome exported = export_in(dir, work, {checkpoint, "-o", "gpt-hf", "--format", "hf-gpt2"});
  ASSERT_EQ(exported.status, 0) << exported.output;
  const auto written = listing(work);
  EXPECT_EQ(names_of(written), (std::vector<std::string>{"gpt-hf/", "gpt-hf/config.json", "gpt-hf/model.safetensors"}))
      << exported.output;

  // The FILE.safetensors form: the same files, in the file's directory.
  fs::create_directories(dir / "file");
  const Outcome as_file =
      export_in(dir, work, {checkpoint, "-o", dir / "file/model.safetensors", "--format", "hf-gpt2"});
  ASSERT_EQ(as_file.status, 0) << as_file.output;
  const auto file_form = listing(dir / "file");
  ASSERT_EQ(names_of(file_form), (std::vector<std::string>{"config.json", "model.safetensors"}));
  EXPECT_EQ(file_form.at("model.safetensors"), written.at("gpt-hf/model.safetensors"));
  EXPECT_EQ(file_form.at("config.json"), written.at("gpt-hf/config.json"));

  // Into the directory again: refused, nothing changed; with --force, written.
  fs::remove(fs::path(work) / "gpt-hf/config.json");
  const auto before = listing(work);
  const Outcome again = export_in(dir, work, {checkpoint, "-o", "gpt-hf", "--format", "hf-gpt2"});
  EXPECT_NE(again.status, 0) << again.output;
  EXPECT_TRUE(contains(again.output, "-o gpt-hf is a directory that is not empty")) << again.output;
  EXPECT_TRUE(contains(again.output, "--force")) << again.output;
  EXPECT_EQ(listing(work), before);
  const Outcome forced = export_in(dir, work, {checkpoint, "-o", "gpt-hf", "--format", "hf-gpt2", "--force"});
  ASSERT_EQ(forced.status, 0) << forced.output;
  EXPECT_EQ(listing(work), written);

  // Beside a FILE.safetensors, a config.json not asked for is not replaced.
  fs::create_directories(dir / "mine");
  std::ofstream(dir / "mine/config.json") << "mine";
  const auto mine = listing(dir / "mine");
  const Outcome beside =
      export_in(dir, work, {checkpoint, "-o", dir / "mine/model.safetensors", "--format", "hf-gpt2"});
  EXPECT_NE(beside.status, 0) << beside.output;
  EXPECT_TRUE(contains(beside.output, "would replace " + (dir / "mine/config.json"))) << beside.output;
  EXPECT_EQ(listing(dir / "mine"), mine);
}

// GPT-2's dropouts in config.json are those the model was trained with:
// resid_pdrop and embd_pdrop --hidden-dropout, attn_pdrop --attention-dropout
// (0, Tessera's default, when not given).
TEST(Export, HfGpt2ConfigCarriesTheDropoutsTrainedWith) {
  for (const auto& [flags, hidden, attention] :
       {std::tuple{"", 0.0, 0.0}, std::tuple{"--hidden-dropout 0.25 --attention-dropout 0.125", 0.25, 0.125}}) {
    SCOPED_TRACE(flags);
    ScratchDirectory dir("tessera_export_dropout_");
    const std::string checkpoint = small_checkpoint(dir, flags);
    const Outcome exported = export_in(dir, dir.path.string(), {checkpoint, "-o", "hf", "--format", "hf-gpt2"});
    ASSERT_EQ(exported.status, 0) << exported.output;
    const nlohmann::json config = nlohmann::json::parse(std::ifstream(dir / "hf/config.json"));
    EXPECT_EQ(config["resid_pdrop"], hidden);
    EXPECT_EQ(config["embd_pdrop"], hidden);
    EXPECT_EQ(config["attn_pdrop"], attention);
  }
}

// The tensors of a safetensors file, read here field by field: name → (header entry, bytes).
std::map<std::string, std::pair<nlohmann::json, std::string>> tensors_in(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t length = 0;
  std::memcpy(&length, all.data(), sizeof length);
  const nlohmann::json header = nlohmann::json::parse(all.substr(8, length));
  std::map<std::string, std::pair<nlohmann::json, std::string>> out;
  for (const auto& [name, entry] : header.items())
    if (name != "__metadata__") {
      const uint64_t begin = entry["data_offsets"][0], end = entry["data_offsets"][1];
      out[name] = {entry, all.substr(8 + length + begin, end - begin)};
    }
  return out;
}

TEST(Export, HfGpt2AboveMaxShardSizeWritesShardsAndAnIndexAsSavePretrained) {
  ScratchDirectory dir("tessera_export_shards_");
  const std::string checkpoint = small_checkpoint(dir);
  const std::string work = dir / "work";
  fs::create_directories(work);
  ASSERT_EQ(export_in(dir, work, {checkpoint, "-o", "whole", "--format", "hf-gpt2"}).status, 0);
  const Outcome sharded =
      export_in(dir, work, {checkpoint, "-o", "sharded", "--format", "hf-gpt2", "--max-shard-size", "20KB"});
  ASSERT_EQ(sharded.status, 0) << sharded.output;
  const fs::path out = fs::path(work) / "sharded";
  EXPECT_TRUE(contains(sharded.output, "wrote " + std::string("sharded/model.safetensors.index.json")))
      << sharded.output;

  // The index, read here: every tensor of the one-file export, in files named as transformers names them,
  // none above the limit unless alone; the bytes equal the one-file export's.
  const auto whole = tensors_in(fs::path(work) / "whole/model.safetensors");
  const nlohmann::json index = nlohmann::json::parse(std::ifstream(out / "model.safetensors.index.json"));
  ASSERT_EQ(index["weight_map"].size(), whole.size());
  std::map<std::string, int64_t> shard_bytes;
  int64_t total = 0;
  for (const auto& [name, file] : index["weight_map"].items()) {
    const auto in_shard = tensors_in(out / file.get<std::string>());
    ASSERT_TRUE(in_shard.count(name)) << name << " in " << file;
    EXPECT_EQ(in_shard.at(name).second, whole.at(name).second) << name;
    EXPECT_EQ(in_shard.at(name).first["shape"], whole.at(name).first["shape"]) << name;
    shard_bytes[file] += int64_t(in_shard.at(name).second.size());
    total += int64_t(in_shard.at(name).second.size());
  }
  EXPECT_EQ(index["metadata"]["total_size"], total);
  ASSERT_GT(shard_bytes.size(), 2u);
  size_t number = 0;
  for (const auto& [file, bytes] : shard_bytes) {
    char expected[64];
    std::snprintf(expected, sizeof expected, "model-%05zu-of-%05zu.safetensors", ++number, shard_bytes.size());
    EXPECT_EQ(file, expected);
    EXPECT_TRUE(bytes <= 20000 || tensors_in(out / file).size() == 1) << file << " holds " << bytes << " bytes";
  }
  EXPECT_FALSE(fs::exists(out / "model.safetensors"));

  // --force over the one-file export: its model.safetensors (which from_pretrained would prefer) goes.
  const Outcome over =
      export_in(dir, work, {checkpoint, "-o", "whole", "--format", "hf-gpt2", "--max-shard-size", "20KB", "--force"});
  ASSERT_EQ(over.status, 0) << over.output;
  EXPECT_FALSE(fs::exists(fs::path(work) / "whole/model.safetensors"));
  EXPECT_EQ(names_of(listing(fs::path(work) / "whole")), names_of(listing(out)));

  const Outcome bad = export_in(dir, work, {checkpoint, "-o", "bad", "--format", "hf-gpt2", "--max-shard-size", "5XB"});
  EXPECT_NE(bad.status, 0);
  EXPECT_TRUE(contains(bad.output, "--max-shard-size 5XB is not a size")) << bad.output;
  EXPECT_FALSE(fs::exists(fs::path(work) / "bad"));
}

TEST(Export, RefusalsLeaveNothingBehind) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_export_refused_");
  const std::string checkpoint = small_checkpoint(dir);
  // A BPE tokenizer of 300 tokens, more than the model's 64; a byte dataset, which stores none; not HDF5 at all.
  std::mt19937_64 rng = make_rng();
  std::string text;
  std::uniform_int_distribution<int> letter('a', 'h');
  for (int i = 0; i < 20000; ++i) text += i % 6 == 5 ? ' ' : char(letter(rng));
  std::ofstream(dir / "corpus.txt") << text;
  const Outcome prepared = run_command({TESSERA_BINARY, "prepare", "text", "--tokenizer", "bpe", "--vocab-size", "300",
                                        "-o", dir / "bpe.h5", dir / "corpus.txt"},
                                       dir / "prepare.log", seconds(120));
  ASSERT_EQ(prepared.status, 0) << prepared.output;
  const std::string bytes = write_text_dataset(dir.path, 4000, rng);
  std::ofstream(dir / "notes.txt") << "not a dataset\n";

  const std::string work = dir / "work";
  fs::create_directories(work);
  const struct {
    std::vector<std::string> args;
    std::string expected;
  } cases[] = {
      {{"-o", "gpt-hf", "--tokenizer", dir / "bpe.h5"}, "300 tokens, more than the model's vocabulary of 64"},
      {{"-o", "gpt-hf", "--tokenizer", bytes}, "--tokenizer " + bytes + " stores no tokenizer"},
      {{"-o", "gpt-hf", "--tokenizer", dir / "notes.txt"},
       "--tokenizer " + (dir / "notes.txt") + " is not an HDF5 file"},
      {{"-o", (dir / "notes.txt") + "/gpt-hf"}, (dir / "notes.txt") + " is a file, not a directory"},
  };
  for (const auto& refused : cases) {
    SCOPED_TRACE(shell_words(refused.args));
    const Outcome out = export_in(dir, work, joined({checkpoint, "--format", "hf-gpt2"}, refused.args));
    EXPECT_NE(out.status, 0) << out.output;
    EXPECT_TRUE(contains(out.output, refused.expected)) << out.output;
    EXPECT_FALSE(contains(out.output, "H5Fopen")) << "HDF5's raw error stack:\n" << out.output;
    EXPECT_TRUE(listing(work).empty()) << "left behind: " << shell_words(names_of(listing(work)));
  }
}

// The Hugging Face format is chosen by the architecture: a Llama with experts
// in only some blocks (--moe-layer-freq 2) is refused by hf-mixtral naming
// --moe-layer-freq and by hf-llama naming --num-experts, both pointing to
// --format tessera; a dense Llama is refused by hf-mixtral pointing to
// hf-llama. Nothing is left behind.
TEST(Export, HuggingFaceFormatsRefuseExpertsTheirClassDoesNotHave) {
  ScratchDirectory dir("tessera_export_experts_");
  const std::string llama =
      "--model llama --synthetic --vocab-size 64 --seq-length 16 --num-layers 2 --num-heads 2 --hidden-size 32 "
      "--micro-batch-size 4 --train-steps 1 --threads 1 ";
  run_training(1, words(llama + "--num-experts 4 --moe-layer-freq 2 --save " + (dir / "some")), dir / "some.log");
  run_training(1, words(llama + "--save " + (dir / "dense")), dir / "dense.log");
  const std::string work = dir / "work";
  fs::create_directories(work);
  const struct {
    std::string checkpoint, format, expected;
  } cases[] = {
      {dir / "some", "hf-mixtral",
       "holds a model with experts only in some blocks (--moe-layer-freq 2), which MixtralForCausalLM does not have; "
       "export it with --format tessera"},
      {dir / "some", "hf-llama",
       "holds a model with experts (--num-experts), which LlamaForCausalLM does not have; export it with --format "
       "tessera"},
      {dir / "dense", "hf-mixtral",
       "holds a model with dense MLPs (no --num-experts), which MixtralForCausalLM does not have; export it with "
       "--format hf-llama"},
  };
  for (const auto& refused : cases) {
    SCOPED_TRACE(refused.checkpoint + " as " + refused.format);
    const Outcome out = export_in(dir, work, {refused.checkpoint, "--format", refused.format, "-o", "hf"});
    EXPECT_NE(out.status, 0) << out.output;
    EXPECT_TRUE(contains(out.output, "export --format " + refused.format + ": checkpoint ")) << out.output;
    EXPECT_TRUE(contains(out.output, refused.expected)) << out.output;
    EXPECT_TRUE(listing(work).empty()) << "left behind: " << shell_words(names_of(listing(work)));
  }
  const Outcome tessera = export_in(dir, work, {dir / "some", "--format", "tessera", "-o", "some.safetensors"});
  EXPECT_EQ(tessera.status, 0) << tessera.output;
}

TEST(Export, RefusesToWriteOverTheCheckpointItReads) {
  ScratchDirectory dir("tessera_export_input_");
  const std::string save = small_checkpoint(dir);
  const std::string step = save + "/" + step_name(2);
  fs::create_symlink(step + "/checkpoint.h5", dir / "link.h5");
  const auto before = listing(save);
  for (const auto& [output, format] :
       std::vector<std::pair<std::string, std::string>>{{step + "/checkpoint.h5", "tessera"},
                                                        {step + "/model.safetensors", "tessera"},
                                                        {dir / "link.h5", "tessera"},
                                                        {step, "hf-gpt2"},
                                                        {step + "/checkpoint.h5", "hf-gpt2"}}) {
    SCOPED_TRACE(output + " " + format);
    const Outcome out = export_in(dir, dir.path.string(), {save, "-o", output, "--format", format});
    EXPECT_NE(out.status, 0) << out.output;
    EXPECT_TRUE(contains(out.output, "lies inside the checkpoint being read (" + step + ")")) << out.output;
    EXPECT_EQ(listing(save), before) << "the checkpoint changed";
  }
  const Outcome verified =
      run_command({TESSERA_BINARY, "checkpoint", "inspect", save}, dir / "inspect.log", seconds(60));
  EXPECT_EQ(verified.status, 0) << verified.output;
}

}  // namespace
}  // namespace tessera::testing
