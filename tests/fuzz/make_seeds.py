#!/usr/bin/env python3
"""Writes the hand-made seeds of the fuzz corpora (tests/fuzz/corpus/<harness>/seed-*).

Each seed is a valid input in the harness's own input format (described at the
top of its LLVMFuzzerTestOneInput), so a short run starts from inputs that get
past the first checks. The structure-aware harnesses (fuzz_dataset,
fuzz_checkpoint, fuzz_topology) decode an empty input to a valid file or tree
and need no hand-made seed. Besides the seeds, each corpus (but
fuzz_canary's) holds inputs kept from earlier runs, named by their SHA-1: a
small set covering every edge those runs reached (`-set_cover_merge=1`, see
docs/development.md, "Fuzzing").

    tests/fuzz/make_seeds.py      # rewrites the seed-* files, leaves the others
"""
import gzip
import json
import os
import struct

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(harness, name, data):
    folder = os.path.join(CORPUS, harness)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "seed-" + name), "wb") as out:
        out.write(data)


def idx_labels(labels):
    return struct.pack(">II", 0x00000801, len(labels)) + bytes(labels)


def idx_images(count, height, width):
    pixels = bytes((i * 37) % 256 for i in range(count * height * width))
    return struct.pack(">IIII", 0x00000803, count, height, width) + pixels


def prepare_idx(flags, num_classes, labels, images):
    # flags (1: gzip images, 2: gzip labels, 4: --num-classes, 8: --num-classes -1),
    # the --num-classes byte, the label file's length (LE16), labels, images.
    if flags & 1:
        images = gzip.compress(images, mtime=0)
    if flags & 2:
        labels = gzip.compress(labels, mtime=0)
    return bytes([flags, num_classes]) + struct.pack("<H", len(labels)) + labels + images


def prepare_text(flags, fraction_code, files):
    # flags (bits 0-1: files - 1; 4: eval file; 8: eval file named like the
    # output), the fraction code, each file's length but the last's (LE16), the files.
    assert (flags & 3) + 1 == len(files)
    lengths = b"".join(struct.pack("<H", len(f)) for f in files[:-1])
    return bytes([flags, fraction_code]) + lengths + b"".join(files)


def gpt2_characters():
    # GPT-2's bytes_to_unicode(): printable bytes as themselves, the others from U+0100 up.
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    others = [b for b in range(256) if b not in printable]
    return printable + others, {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def tokenizer_gpt2(flags, tokens, merges, text):
    # flags (bit 1: write and re-read the files), vocab.json, NUL, merges.txt, NUL, the text to encode.
    order, char = gpt2_characters()
    spell = lambda token: "".join(char[b] for b in token)
    vocab = {spell([b]): i for i, b in enumerate(order)}
    for token in tokens:
        vocab[spell(token)] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    lines = "#version: 0.2\n" + "".join(spell(a) + " " + spell(b) + "\n" for a, b in merges)
    return (bytes([flags]) + json.dumps(vocab, ensure_ascii=False).encode() + b"\0" + lines.encode() + b"\0"
            + text)


def safetensors(tensors):
    # (name, dtype, shape, bytes) in order, with {"format": "pt"} as save_pretrained writes it.
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors)


def hf_llama(flags, config, index, first, second):
    # A flags byte (bit 0: one model.safetensors), then config.json, the index and two files, each length-prefixed.
    return bytes([flags]) + b"".join(struct.pack("<I", len(part)) + part for part in (config, index, first, second))


def main():
    labels, images = idx_labels([1, 0]), idx_images(2, 4, 4)
    write("fuzz_prepare_idx", "plain", prepare_idx(0, 0, labels, images))
    write("fuzz_prepare_idx", "gzip", prepare_idx(3, 0, labels, images))
    write("fuzz_prepare_idx", "classes", prepare_idx(4, 10, idx_labels([3]), idx_images(1, 2, 2)))
    write("fuzz_canary", "plain", prepare_idx(0, 0, labels, images))

    write("fuzz_prepare_text", "one", prepare_text(4, 13, [b"Tessera trains models on MPI ranks.\n" * 3]))
    write("fuzz_prepare_text", "three", prepare_text(2, 0, [b"abc", b"", b"defghij\n"]))
    write("fuzz_prepare_text", "eval", prepare_text(5, 128, [b"0123456789", b"abcdefghij"]))

    # The tokenizer: GPT-2 files and a text, or (flags bit 0) a vocabulary size byte and a text to train on.
    merges = [(b" ", b"t"), (b"h", b"e"), (b" t", b"he"), (b"i", b"n"), (b"\xc3", b"\xa9"), (b" the", b"r")]
    write("fuzz_tokenizer", "gpt2", tokenizer_gpt2(0, [a + b for a, b in merges], merges,
                                                   b"the other there caf\xc3\xa9 in\n\xff\xfe"))
    write("fuzz_tokenizer", "gpt2-rewrite", tokenizer_gpt2(2, [b"ab", b"aba"], [(b"ab", b"a"), (b"a", b"b")], b"abab aba"))
    write("fuzz_tokenizer", "train", b"\x01\x40" + b"the cat sat on the mat; the rat ate the oat.\n" * 4)
    write("fuzz_tokenizer", "train-save", b"\x03\x10" + b"ab ab abab \xe2\x82 \xff\xff x  \t\n" * 3)

    # The TOML file, then a NUL and one command-line argument per line.
    write("fuzz_train_config", "gpt",
          b'model = "gpt"\nsynthetic = true\ntrain-steps = 10\nseq-length = 64\nnum-layers = 2\n'
          b'hidden-size = 64\nnum-heads = 4\nlr = 3e-4\nmin-lr = 1e-5\nprecision = "bf16"\n')
    write("fuzz_train_config", "mlp",
          b'# an MLP\nmodel = "mlp"\nhidden = [128, 64]\nsynthetic = true\ntrain-steps = 5\n'
          b'micro_batch_size = 32\nglobal-batch-size = 64\noptimizer = "sgd"\nnesterov = true\n'
          b"\0--lr\n0.01\n--clip-grad=0")
    write("fuzz_train_config", "flags",
          b'epochs = 2.5\n[tessera]\nseed = 7\n\0--synthetic\n--train-steps\n3\n--model\ncnn\n--tp\n1\n--zero\n1')
    write("fuzz_train_config", "save",
          b'synthetic = true\ntrain-steps = 20\nsave = "runs/x"\nsave-interval = 5\nkeep-checkpoints = 2\n'
          b'resume = "auto"\nbucket-size-mb = 0.5\npipeline-parallel = 2\npipeline-split = "0,1,2"\n')

    # A plot-options byte, then a metrics JSONL file as `tessera train --metrics` writes it.
    metrics = (b'{"kind":"run","model":"mlp","precision":"fp32","world_size":"1","wall_time":1795325108.64}\n'
               + b"".join(b'{"kind":"train","step":%d,"total_steps":6,"epoch":0,"loss":%.3f,"lr":0.001,'
                          b'"ms_per_step":0.3,"samples_per_s":25949.7,"grad_norm":2.5,"skipped":false,'
                          b'"wall_time":1795325108.%d}\n' % (step, 2.3 / step, step) for step in range(1, 7))
               + b'{"kind":"eval","step":6,"eval_loss":0.39,"eval_accuracy":0.91,"wall_time":1795325109.0}\n')
    write("fuzz_metrics", "run", b"\x00" + metrics)
    write("fuzz_metrics", "cut", b"\x65" + metrics + b'{"kind":"train","step":7,"loss":nu')
    write("fuzz_metrics", "tokens",
          b"\x12" + b'{"kind":"train","step":3,"loss":1.5,"lr":1e-4,"tokens_per_s":1e5,"skipped":true}\n'
          b'{"kind":"eval","step":3,"eval_loss":null,"eval_bits_per_byte":2.1}\n'
          b'{"kind":"train","step":3,"loss":1.25,"lr":-0.0,"tokens_per_s":1e300}\n')

    # A Hugging Face Llama directory: config.json, then shards and their index (or one model.safetensors).
    config = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
                         "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
                         "rope_theta": 500000.0, "tie_word_embeddings": False, "rope_scaling": None,
                         "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}, indent=2).encode()
    first = safetensors([("model.embed_tokens.weight", "BF16", [2, 3], bytes(range(12))),
                         ("model.norm.weight", "F32", [2], struct.pack("<2f", 1.0, -0.5))])
    second = safetensors([("lm_head.weight", "F16", [3], struct.pack("<3e", 0.25, 2.0, -1.0)),
                          ("model.layers.0.mlp.up_proj.weight", "F64", [1, 2], struct.pack("<2d", 1e-3, 7.0))])
    index = json.dumps({"metadata": {"total_size": 42}, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors",
        "model.layers.0.mlp.up_proj.weight": "model-00002-of-00002.safetensors"}}, indent=2).encode()
    write("fuzz_hf_llama", "sharded", hf_llama(0, config, index, first, second))
    write("fuzz_hf_llama", "single", hf_llama(1, config, b"", first, b""))


if __name__ == "__main__":
    main()
