// A Llama made by Hugging Face's own classes (transformers' LlamaForCausalLM,
// and a MixtralForCausalLM under expert parallelism,
// with random weights: 2 key/value groups of 2 query heads, untied,
// rope_theta 500000; saved by save_pretrained, also as shards and in bf16)
// loaded into Tessera's Llama under tensor parallelism 2 (each rank reading
// its slices): the logits of a sequence equal transformers' within f32
// rounding. Rank 0 makes the model with tests/support/hf_llama.py in the venv
// scripts/install-hf.sh installs (scripts/install-deps.sh runs it).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <unistd.h>

#include "core/context.h"
#include "io/hf_llama.h"
#include "models/registry.h"
#include "parallel/layout.h"
#include "parallel/tensor_parallel.h"
#include "tests/mpi/mpi_test.h"
#include "tests/support/test_support.h"

#ifndef TESSERA_HF_LLAMA_SCRIPT
#error "tests/CMakeLists.txt defines TESSERA_HF_LLAMA_SCRIPT, the path of tests/support/hf_llama.py"
#endif

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;

fs::path hf_python() {
  const char* tools = std::getenv("TESSERA_TOOLS_DIR");
  return fs::path(tools && *tools ? tools : "/opt/tessera-tools") / "hf" / "bin" / "python";
}

// Rank 0 makes the model (save_pretrained with `extra` arguments) and its logits of `ids`; every rank reads them.
std::vector<std::vector<double>> make_hf_llama(parallel::Communicator& comm, Context& ctx, const fs::path& dir,
                                               const std::string& ids, const std::string& extra) {
  const fs::path json = dir.string() + ".json";
  int status = 0;
  if (comm.rank() == 0) {
    const std::string command = hf_python().string() + " " + TESSERA_HF_LLAMA_SCRIPT + " make " + dir.string() +
                                " --json " + json.string() + " --ids " + ids + " --seed " +
                                std::to_string(test_seed() % 100000) + " " + extra + " > " + dir.string() +
                                ".log 2>&1";
    status = std::system(command.c_str());
  }
  Tensor flag = ctx.from_vector(Shape{1}, std::vector<int32_t>{status});
  comm.broadcast(flag, 0)->wait();
  EXPECT_EQ(flag.to_vector<int32_t>()[0], 0) << "hf_llama.py make failed: see " << dir.string() << ".log";
  if (flag.to_vector<int32_t>()[0] != 0) return {};
  const nlohmann::json printed = nlohmann::json::parse(std::ifstream(json));
  return printed["logits"].get<std::vector<std::vector<double>>>();
}

// The whole vocabulary's logits [T, V] of Tessera's Llama split over
// `layout`'s tp group (a Mixtral's experts over its ep group), loaded from `dir`.
std::vector<double> tessera_logits(Context& ctx, parallel::Layout& layout, const fs::path& dir,
                                   const std::vector<int32_t>& ids, DType dtype) {
  const io::HfLlamaConfig hf = io::read_hf_llama_config(dir.string());
  const nn::ModelConfig config = io::llama_model_config(hf, int64_t(ids.size()));
  parallel::TensorParallelism split{&layout.group("tp"), false};
  split.experts = &layout.group("ep");
  auto model = models::model_row(nn::ModelKind::llama)
                   .build(config, nn::ModelSpec{&ctx, Device::cpu(), dtype, 1}, split, nn::StageLayers{});
  io::load_hf_llama_weights(dir.string(), model->parameters(), hf);
  model->train(false);
  nn::Saved saved;
  const Tensor local = model->forward(ctx.from_vector(Shape{1, int64_t(ids.size())}, ids), saved, nn::Pass{});
  Tensor f32 = ctx.empty(local.shape(), DType::f32, Device::cpu());
  ops::cast(local, f32);
  return parallel::tp_gather_last_dim(layout.group("tp"), f32).to_doubles();
}

// One scratch directory for the job: rank 0's name, broadcast; made, and removed by remove_job_directory.
std::string job_directory(parallel::Communicator& comm, Context& ctx, const std::string& prefix) {
  std::string base;
  if (comm.rank() == 0) base = (fs::temp_directory_path() / (prefix + std::to_string(::getpid()))).string();
  Tensor name = ctx.from_vector(Shape{256}, std::vector<int32_t>(256, 0));
  if (comm.rank() == 0)
    for (size_t i = 0; i < base.size() && i < 255; ++i) name.data<int32_t>()[i] = base[i];
  comm.broadcast(name, 0)->wait();
  base.clear();
  for (const int32_t c : name.to_vector<int32_t>())
    if (c) base += char(c);
  if (comm.rank() == 0) fs::create_directories(base);
  comm.barrier();
  return base;
}

void remove_job_directory(parallel::Communicator& comm, const std::string& base) {
  comm.barrier();
  if (comm.rank() == 0) fs::remove_all(base);
}

struct HfCase {
  const char* name;
  std::string extra;  // hf_llama.py make's arguments
  Tolerance tolerance;
};

// Each case's transformers model, made by rank 0, loaded under `layout`: its logits of the ids.
void expect_transformers_logits(parallel::Communicator& comm, Context& ctx, parallel::Layout& layout,
                                const std::string& base, const std::vector<HfCase>& cases) {
  const std::vector<int32_t> ids = {3, 17, 90, 5, 44, 44, 61, 2, 0, 95, 12};
  const std::string id_text = "3,17,90,5,44,44,61,2,0,95,12";
  for (const HfCase& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path dir = fs::path(base) / std::to_string(&c - cases.data());
    const std::vector<std::vector<double>> expected = make_hf_llama(comm, ctx, dir, id_text, c.extra);
    ASSERT_EQ(expected.size(), ids.size());
    std::vector<double> want;
    for (const auto& row : expected) want.insert(want.end(), row.begin(), row.end());
    EXPECT_TRUE(all_close(tessera_logits(ctx, layout, dir, ids, DType::f32), want, c.tolerance));
  }
}

TEST(HfLlamaMpi, TransformersModelLoadedUnderTensorParallelTwoGivesItsLogits) {
  TESSERA_SEED_TRACE();
  if (!fs::exists(hf_python()))
    GTEST_SKIP() << "no transformers in " << hf_python() << ": run scripts/install-deps.sh (scripts/install-hf.sh)";
  auto comm = world();
  Context ctx(one_thread());
  parallel::LayoutSizes sizes;
  sizes.tp = 2;
  parallel::Layout layout(*comm, sizes);
  const std::string base = job_directory(*comm, ctx, "tessera_hf_llama_mpi_");
  expect_transformers_logits(*comm, ctx, layout, base,
                             {HfCase{"one file", "", Tolerance{2e-4, 2e-4}},
                              HfCase{"shards", "--max-shard-size 60KB", Tolerance{2e-4, 2e-4}}});
  remove_job_directory(*comm, base);
}

// transformers' MixtralForCausalLM (4 experts per layer, top-2; G < H,
// untied, rope_theta 500000; one file and shards) loaded with its experts
// split over 2 expert-parallel ranks (on 4 ranks also tp 2): each rank reads
// only its experts, routes the tokens through the all-to-all, and the
// logits equal transformers'.
TEST(HfLlamaMpi, TransformersMixtralLoadedUnderExpertParallelTwoGivesItsLogits) {
  TESSERA_SEED_TRACE();
  if (!fs::exists(hf_python()))
    GTEST_SKIP() << "no transformers in " << hf_python() << ": run scripts/install-deps.sh (scripts/install-hf.sh)";
  auto comm = world();
  if (comm->size() % 2 != 0) GTEST_SKIP() << "2 expert-parallel ranks need an even world, not " << comm->size();
  Context ctx(one_thread());
  parallel::LayoutSizes sizes;
  sizes.ep = 2;
  sizes.tp = comm->size() / 2 > 2 ? 1 : comm->size() / 2;
  parallel::Layout layout(*comm, sizes);
  const std::string base = job_directory(*comm, ctx, "tessera_hf_mixtral_mpi_");
  expect_transformers_logits(*comm, ctx, layout, base,
                             {HfCase{"one file", "--experts 4", Tolerance{2e-4, 2e-4}},
                              HfCase{"shards", "--experts 4 --max-shard-size 60KB", Tolerance{2e-4, 2e-4}}});
  remove_job_directory(*comm, base);
}

}  // namespace
}  // namespace tessera::testing
