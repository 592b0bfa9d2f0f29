// `tessera export`: a GPT trained by `tessera train` (2 ranks, dp 1 × tp 2,
// so the checkpoint's tensors are stitched from shards) is exported with
// --format hf-gpt2; Python with the `safetensors` package and NumPy (the
// pinned tools environment scripts/install-deps.sh makes) loads the file and
// config.json, runs a GPT-2 forward written independently in the test in
// float64, and matches the logits Tessera's own model computes from the same
// checkpoint (1e-4). --format tessera keeps Tessera's names and no optimizer
// state; a non-GPT checkpoint is refused for hf-gpt2.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/context.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "nn/models.h"
#include "parallel/stage_model.h"
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
  auto model = parallel::build_model(config, spec);
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

}  // namespace
}  // namespace tessera::testing
