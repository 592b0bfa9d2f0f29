// Corpora tokenized by other tools, through the `tessera` binary: an llm.c
// token shard and a Megatron-LM indexed dataset (written by Python's struct
// module from the documented layouts, independently of Tessera's readers) go
// through `tessera prepare llmc|megatron` and a 2-rank GPT trains on the
// result; a broken header fails the command naming the file and the field.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "io/dataset.h"
#include "tests/support/process_job.h"
#include "tests/support/resume_support.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::seconds;

// Writes `dir`/shard.bin (llm.c, version 1) and `dir`/corpus.{idx,bin}
// (Megatron, uint16, several documents) of `tokens` random ids below `vocab`
// with Python; returns its output.
Outcome write_with_python(const ScratchDirectory& dir, int tokens, int vocab, uint64_t seed) {
  const std::string script = R"(
import random, struct, sys
out, n, vocab, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
ids = [rng.randrange(vocab) for _ in range(n)]
with open(out + '/shard.bin', 'wb') as f:
    f.write(struct.pack('<256i', 20240520, 1, n, *([0] * 253)))
    f.write(struct.pack('<%dH' % n, *ids))
cuts = sorted(rng.sample(range(1, n), 9))
sequences = [ids[a:b] for a, b in zip([0] + cuts, cuts + [n])]
pointers, offset = [], 0
for s in sequences:
    pointers.append(offset)
    offset += 2 * len(s)
with open(out + '/corpus.bin', 'wb') as f:
    for s in sequences:
        f.write(struct.pack('<%dH' % len(s), *s))
documents = [0, 3, 7, len(sequences)]
with open(out + '/corpus.idx', 'wb') as f:
    f.write(b'MMIDIDX\x00\x00' + struct.pack('<Q', 1) + bytes([8]))
    f.write(struct.pack('<QQ', len(sequences), len(documents)))
    f.write(struct.pack('<%di' % len(sequences), *[len(s) for s in sequences]))
    f.write(struct.pack('<%dq' % len(sequences), *pointers))
    f.write(struct.pack('<%dq' % len(documents), *documents))
)";
  return run_command({"/usr/bin/python3", "-c", script, dir.path.string(), std::to_string(tokens),
                      std::to_string(vocab), std::to_string(seed)},
                     dir / "python.log", seconds(60));
}

TEST(PreparedCorpora, LlmcAndMegatronFilesPrepareAndTrain) {
  TESSERA_SEED_TRACE();
  ScratchDirectory dir("tessera_corpora_");
  std::mt19937_64 rng = make_rng();
  const Outcome python = write_with_python(dir, 6000, 512, rng());
  ASSERT_EQ(python.status, 0) << python.output;

  for (const std::vector<std::string>& prepare :
       {std::vector<std::string>{"llmc", dir / "shard.bin"}, std::vector<std::string>{"megatron", dir / "corpus"}}) {
    SCOPED_TRACE(prepare[0]);
    const std::string out = dir / (prepare[0] + ".h5");
    const Outcome prepared =
        run_command(joined({TESSERA_BINARY, "prepare"}, joined(prepare, {"-o", out, "--vocab-size", "512"})),
                    dir / (prepare[0] + "_prepare.log"), seconds(60));
    ASSERT_EQ(prepared.status, 0) << prepared.output;
    EXPECT_TRUE(contains(prepared.output, "wrote " + out)) << prepared.output;
    const io::DatasetInfo info = io::inspect_dataset(out);
    EXPECT_EQ(info.vocab_size, 512);
    EXPECT_EQ(info.num_tokens + io::inspect_dataset(dir / (prepare[0] + ".eval.h5")).num_tokens, 6000);
    const std::string trained = run_training(
        2,
        words("--model gpt --seq-length 16 --num-layers 2 --num-heads 2 --hidden-size 32 --micro-batch-size 4 "
              "--vocab-size 512 --train-steps 3 --threads 1 --data " +
              out),
        dir / (prepare[0] + "_train.log"));
    EXPECT_TRUE(contains(trained, "done: 3 steps")) << trained;
  }

  // The shard's magic broken: the command fails naming the file and the field.
  {
    std::fstream shard(dir / "shard.bin", std::ios::in | std::ios::out | std::ios::binary);
    shard.write("\x01\x02\x03\x04", 4);
  }
  const Outcome refused = run_command({TESSERA_BINARY, "prepare", "llmc", dir / "shard.bin", "-o", dir / "x.h5"},
                                      dir / "refused.log", seconds(60));
  EXPECT_NE(refused.status, 0);
  EXPECT_TRUE(contains(refused.output, dir / "shard.bin" + ": header[0] (magic) is 67305985")) << refused.output;
  EXPECT_FALSE(fs::exists(dir / "x.h5"));
}

}  // namespace
}  // namespace tessera::testing
