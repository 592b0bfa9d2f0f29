// What the Hugging Face Llama tests share, written here independently of
// io/'s code: Hugging Face's tensor names in state_dict order, the logical
// (Tessera) tensors built from them by placing every head's rows where the
// design puts them (q head h of kv group h / R, as transformers' repeat_kv
// pairs them), the parameters of one tensor-parallel rank as the design
// shards them and the slice each must hold (taken by rows and columns here,
// not by nn::shard_runs), and a safetensors writer and reader of their own
// (header JSON through nlohmann::json, bytes by hand).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/context.h"
#include "core/half.h"
#include "io/hf_llama.h"
#include "nn/parameter.h"
#include "tests/support/test_support.h"

namespace tessera::testing {

struct HostTensor {
  Shape shape;
  std::vector<double> values;  // row-major
};
using NamedTensors = std::map<std::string, HostTensor>;

inline io::HfLlamaConfig tiny_llama(int64_t vocab, int64_t hidden, int64_t heads, int64_t kv_heads,
                                    int64_t intermediate, int64_t layers) {
  io::HfLlamaConfig c;
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.intermediate_size = intermediate;
  c.num_hidden_layers = layers;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  return c;
}

// The sizes and the rotary/norm constants of `c` are those of `expected`.
inline void expect_same_llama(const io::HfLlamaConfig& c, const io::HfLlamaConfig& expected) {
  EXPECT_EQ(c.vocab_size, expected.vocab_size);
  EXPECT_EQ(c.hidden_size, expected.hidden_size);
  EXPECT_EQ(c.intermediate_size, expected.intermediate_size);
  EXPECT_EQ(c.num_hidden_layers, expected.num_hidden_layers);
  EXPECT_EQ(c.num_attention_heads, expected.num_attention_heads);
  EXPECT_EQ(c.num_key_value_heads, expected.num_key_value_heads);
  EXPECT_EQ(c.max_position_embeddings, expected.max_position_embeddings);
  EXPECT_EQ(c.rms_norm_eps, expected.rms_norm_eps);
  EXPECT_EQ(c.rope_theta, expected.rope_theta);
  EXPECT_EQ(c.tie_word_embeddings, expected.tie_word_embeddings);
}

// Hugging Face's tensors and shapes, in LlamaForCausalLM's state_dict order.
inline std::vector<std::pair<std::string, Shape>> hf_llama_tensor_shapes(const io::HfLlamaConfig& c) {
  const int64_t V = c.vocab_size, C = c.hidden_size, F = c.intermediate_size, Dh = C / c.num_attention_heads;
  std::vector<std::pair<std::string, Shape>> out = {{"model.embed_tokens.weight", Shape{V, C}}};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string l = "model.layers." + std::to_string(i) + ".";
    out.insert(out.end(), {{l + "self_attn.q_proj.weight", Shape{c.num_attention_heads * Dh, C}},
                           {l + "self_attn.k_proj.weight", Shape{c.num_key_value_heads * Dh, C}},
                           {l + "self_attn.v_proj.weight", Shape{c.num_key_value_heads * Dh, C}},
                           {l + "self_attn.o_proj.weight", Shape{C, C}},
                           {l + "mlp.gate_proj.weight", Shape{F, C}},
                           {l + "mlp.up_proj.weight", Shape{F, C}},
                           {l + "mlp.down_proj.weight", Shape{C, F}},
                           {l + "input_layernorm.weight", Shape{C}},
                           {l + "post_attention_layernorm.weight", Shape{C}}});
  }
  out.push_back({"model.norm.weight", Shape{C}});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", Shape{V, C}});
  return out;
}

// Tessera's parameter names (the design's) and logical shapes.
inline std::vector<std::pair<std::string, Shape>> tessera_llama_shapes(const io::HfLlamaConfig& c) {
  const int64_t V = c.vocab_size, C = c.hidden_size, F = c.intermediate_size, H = c.num_attention_heads,
                G = c.num_key_value_heads, Dh = C / H;
  std::vector<std::pair<std::string, Shape>> out = {{"wte.weight", Shape{V, C}}};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    out.insert(out.end(), {{b + "ln1.weight", Shape{C}},
                           {b + "attn.qkv.weight", Shape{(H + 2 * G) * Dh, C}},
                           {b + "attn.proj.weight", Shape{C, H * Dh}},
                           {b + "ln2.weight", Shape{C}},
                           {b + "mlp.fc.weight", Shape{2 * F, C}},
                           {b + "mlp.proj.weight", Shape{C, F}}});
  }
  out.push_back({"ln_f.weight", Shape{C}});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", Shape{V, C}});
  return out;
}

// Random values for every tensor of `shapes`, as `dtype` stores them.
inline NamedTensors random_tensors(const std::vector<std::pair<std::string, Shape>>& shapes, DType dtype,
                                   std::mt19937_64& rng) {
  std::uniform_real_distribution<double> value(-2.0, 2.0);
  NamedTensors out;
  for (const auto& [name, shape] : shapes) {
    std::vector<double> values(size_t(shape.numel()));
    for (double& v : values) v = value(rng);
    out[name] = {shape, round_to(dtype, std::move(values))};
  }
  return out;
}

// Row `row` of a [rows, columns] tensor.
inline std::vector<double> row_of(const HostTensor& t, int64_t row) {
  const int64_t columns = t.shape[1];
  return std::vector<double>(t.values.begin() + row * columns, t.values.begin() + (row + 1) * columns);
}

inline void set_row(HostTensor& t, int64_t row, const std::vector<double>& values) {
  std::copy(values.begin(), values.end(), t.values.begin() + row * t.shape[1]);
}

// The logical row of row `d` of q head h (grouped layout: group h / R, slot h % R), of k/v head g (slots R, R + 1).
inline int64_t q_row(const io::HfLlamaConfig& c, int64_t h, int64_t d) {
  const int64_t R = c.num_attention_heads / c.num_key_value_heads, Dh = c.hidden_size / c.num_attention_heads;
  return ((h / R) * (R + 2) + h % R) * Dh + d;
}
inline int64_t kv_row(const io::HfLlamaConfig& c, int64_t g, int64_t slot, int64_t d) {
  const int64_t R = c.num_attention_heads / c.num_key_value_heads, Dh = c.hidden_size / c.num_attention_heads;
  return (g * (R + 2) + R + slot) * Dh + d;
}

// Tessera's logical tensors from Hugging Face's (every head's rows placed; gate rows then up rows).
inline NamedTensors logical_from_hf(const io::HfLlamaConfig& c, const NamedTensors& hf) {
  const int64_t C = c.hidden_size, F = c.intermediate_size, H = c.num_attention_heads, G = c.num_key_value_heads,
                Dh = C / H;
  NamedTensors out;
  for (const auto& [name, shape] : tessera_llama_shapes(c))
    out[name] = {shape, std::vector<double>(size_t(shape.numel()))};
  out["wte.weight"].values = hf.at("model.embed_tokens.weight").values;
  out["ln_f.weight"].values = hf.at("model.norm.weight").values;
  if (!c.tie_word_embeddings) out["lm_head.weight"].values = hf.at("lm_head.weight").values;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".", l = "model.layers." + std::to_string(i) + ".";
    HostTensor& qkv = out[b + "attn.qkv.weight"];
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < Dh; ++d)
        set_row(qkv, q_row(c, h, d), row_of(hf.at(l + "self_attn.q_proj.weight"), h * Dh + d));
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < Dh; ++d) {
        set_row(qkv, kv_row(c, g, 0, d), row_of(hf.at(l + "self_attn.k_proj.weight"), g * Dh + d));
        set_row(qkv, kv_row(c, g, 1, d), row_of(hf.at(l + "self_attn.v_proj.weight"), g * Dh + d));
      }
    HostTensor& fc = out[b + "mlp.fc.weight"];
    for (int64_t f = 0; f < F; ++f) {
      set_row(fc, f, row_of(hf.at(l + "mlp.gate_proj.weight"), f));
      set_row(fc, F + f, row_of(hf.at(l + "mlp.up_proj.weight"), f));
    }
    out[b + "attn.proj.weight"].values = hf.at(l + "self_attn.o_proj.weight").values;
    out[b + "mlp.proj.weight"].values = hf.at(l + "mlp.down_proj.weight").values;
    out[b + "ln1.weight"].values = hf.at(l + "input_layernorm.weight").values;
    out[b + "ln2.weight"].values = hf.at(l + "post_attention_layernorm.weight").values;
  }
  return out;
}

// Hugging Face's tensors from Tessera's logical ones (the inverse placement).
inline NamedTensors hf_from_logical(const io::HfLlamaConfig& c, const NamedTensors& logical) {
  const int64_t F = c.intermediate_size, H = c.num_attention_heads, G = c.num_key_value_heads, Dh = c.hidden_size / H;
  NamedTensors out;
  for (const auto& [name, shape] : hf_llama_tensor_shapes(c))
    out[name] = {shape, std::vector<double>(size_t(shape.numel()))};
  out["model.embed_tokens.weight"].values = logical.at("wte.weight").values;
  out["model.norm.weight"].values = logical.at("ln_f.weight").values;
  if (!c.tie_word_embeddings) out["lm_head.weight"].values = logical.at("lm_head.weight").values;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".", l = "model.layers." + std::to_string(i) + ".";
    const HostTensor& qkv = logical.at(b + "attn.qkv.weight");
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < Dh; ++d)
        set_row(out[l + "self_attn.q_proj.weight"], h * Dh + d, row_of(qkv, q_row(c, h, d)));
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < Dh; ++d) {
        set_row(out[l + "self_attn.k_proj.weight"], g * Dh + d, row_of(qkv, kv_row(c, g, 0, d)));
        set_row(out[l + "self_attn.v_proj.weight"], g * Dh + d, row_of(qkv, kv_row(c, g, 1, d)));
      }
    const HostTensor& fc = logical.at(b + "mlp.fc.weight");
    for (int64_t f = 0; f < F; ++f) {
      set_row(out[l + "mlp.gate_proj.weight"], f, row_of(fc, f));
      set_row(out[l + "mlp.up_proj.weight"], f, row_of(fc, F + f));
    }
    out[l + "self_attn.o_proj.weight"].values = logical.at(b + "attn.proj.weight").values;
    out[l + "mlp.down_proj.weight"].values = logical.at(b + "mlp.proj.weight").values;
    out[l + "input_layernorm.weight"].values = logical.at(b + "ln1.weight").values;
    out[l + "post_attention_layernorm.weight"].values = logical.at(b + "ln2.weight").values;
  }
  return out;
}

// How the design splits a parameter over tensor-parallel ranks.
enum class SplitKind { whole, rows, columns, qkv, fc };
inline SplitKind split_kind(const std::string& name) {
  auto ends = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (name == "wte.weight" || name == "lm_head.weight") return SplitKind::rows;
  if (ends("attn.qkv.weight")) return SplitKind::qkv;
  if (ends("mlp.fc.weight")) return SplitKind::fc;
  if (ends("attn.proj.weight") || ends("mlp.proj.weight")) return SplitKind::columns;
  return SplitKind::whole;
}

// Rank `rank` of `ranks`'s parameter `name` (logical `shape`) as the design shards it, every value NaN.
inline std::unique_ptr<nn::Parameter> design_parameter(Context& ctx, const io::HfLlamaConfig& c,
                                                       const std::string& name, const Shape& shape, int rank, int ranks,
                                                       DType dtype) {
  auto p = std::make_unique<nn::Parameter>();
  p->name = name;
  nn::ParameterShard& s = p->shard;
  s.global_shape = shape;
  const int64_t G = c.num_key_value_heads, R = c.num_attention_heads / G, Dh = c.hidden_size / c.num_attention_heads;
  const SplitKind kind = split_kind(name);
  s.split = ranks > 1 && kind != SplitKind::whole;
  Shape local = shape;
  if (s.split) switch (kind) {
      case SplitKind::rows:
        s = {shape, true, Shape{}, 0, rank * shape[0] / ranks, shape[0] / ranks};
        local = Shape{shape[0] / ranks, shape[1]};
        break;
      case SplitKind::columns:
        s = {shape, true, Shape{}, 1, rank * shape[1] / ranks, shape[1] / ranks};
        local = Shape{shape[0], shape[1] / ranks};
        break;
      case SplitKind::qkv:
        s = {shape, true, Shape{G, R + 2, Dh, shape[1]}, 0, rank * G / ranks, G / ranks};
        local = Shape{G / ranks * (R + 2) * Dh, shape[1]};
        break;
      case SplitKind::fc:
        s = {shape, true, Shape{2, shape[0] / 2, shape[1]}, 1, rank * shape[0] / 2 / ranks, shape[0] / 2 / ranks};
        local = Shape{shape[0] / ranks, shape[1]};
        break;
      case SplitKind::whole:
        break;
    }
  p->value = ctx.empty(local, dtype, Device::cpu());
  p->value.fill_(std::nan(""));
  return p;
}

struct DesignParameters {
  std::vector<std::unique_ptr<nn::Parameter>> owned;
  std::vector<nn::Parameter*> pointers() const {
    std::vector<nn::Parameter*> out;
    for (const auto& p : owned) out.push_back(p.get());
    return out;
  }
};
inline DesignParameters design_parameters(Context& ctx, const io::HfLlamaConfig& c, int rank, int ranks, DType dtype) {
  DesignParameters out;
  for (const auto& [name, shape] : tessera_llama_shapes(c))
    out.owned.push_back(design_parameter(ctx, c, name, shape, rank, ranks, dtype));
  return out;
}

// The values rank `rank` of `ranks` must hold of the logical tensor `t`, taken by rows and columns.
inline std::vector<double> expected_slice(const std::string& name, const HostTensor& t, int rank, int ranks) {
  if (ranks == 1 || split_kind(name) == SplitKind::whole) return t.values;
  std::vector<double> out;
  auto rows = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const std::vector<double> row = row_of(t, r);
      out.insert(out.end(), row.begin(), row.end());
    }
  };
  const int64_t n = t.shape[0];
  switch (split_kind(name)) {
    case SplitKind::rows:
    case SplitKind::qkv:  // whole groups: a contiguous block of rows
      rows(rank * n / ranks, (rank + 1) * n / ranks);
      break;
    case SplitKind::fc:  // this rank's gate rows, then the same rows of up
      rows(rank * n / 2 / ranks, (rank + 1) * n / 2 / ranks);
      rows(n / 2 + rank * n / 2 / ranks, n / 2 + (rank + 1) * n / 2 / ranks);
      break;
    case SplitKind::columns: {
      const int64_t columns = t.shape[1], width = columns / ranks;
      for (int64_t r = 0; r < n; ++r)
        for (int64_t col = rank * width; col < (rank + 1) * width; ++col)
          out.push_back(t.values[size_t(r * columns + col)]);
      break;
    }
    case SplitKind::whole:
      break;
  }
  return out;
}

// ---- safetensors by hand ----

inline const char* stored_name(DType dtype, bool float64 = false) {
  if (float64) return "F64";
  switch (dtype) {
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    default:
      return "F32";
  }
}

// `values` as little-endian bytes of the safetensors dtype `stored` (F64, F32, BF16, F16).
inline std::string encode(const std::vector<double>& values, const std::string& stored) {
  std::string out;
  for (double v : values) {
    char bytes[8];
    size_t size = 0;
    if (stored == "F64") {
      std::memcpy(bytes, &v, size = 8);
    } else if (stored == "F32") {
      const float f = float(v);
      std::memcpy(bytes, &f, size = 4);
    } else {
      const uint16_t bits = stored == "BF16" ? bf16(float(v)).bits : f16(float(v)).bits;
      std::memcpy(bytes, &bits, size = 2);
    }
    out.append(bytes, size);
  }
  return out;
}

inline std::vector<double> decode(const std::string& bytes, const std::string& stored) {
  std::vector<double> out;
  const size_t size = stored == "F64" ? 8 : stored == "F32" ? 4 : 2;
  for (size_t at = 0; at + size <= bytes.size(); at += size) {
    if (stored == "F64") {
      double v;
      std::memcpy(&v, bytes.data() + at, 8);
      out.push_back(v);
    } else if (stored == "F32") {
      float v;
      std::memcpy(&v, bytes.data() + at, 4);
      out.push_back(v);
    } else {
      uint16_t bits;
      std::memcpy(&bits, bytes.data() + at, 2);
      out.push_back(stored == "BF16" ? double(float(bf16::from_bits(bits))) : double(float(f16::from_bits(bits))));
    }
  }
  return out;
}

struct HandTensor {
  std::string name, dtype;  // the header's dtype text
  std::vector<int64_t> shape;
  std::string bytes;
};

// A safetensors file written field by field (any dtype text, any shape: for files io/ would refuse to write).
inline void write_by_hand(const std::string& path, const std::vector<HandTensor>& tensors,
                          const nlohmann::json& metadata = nlohmann::json{{"format", "pt"}}) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.is_null()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const HandTensor& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint64_t length = text.size();
  out.write(reinterpret_cast<const char*>(&length), 8);
  out << text;
  for (const HandTensor& t : tensors) out << t.bytes;
}

inline HandTensor hand_tensor(const std::string& name, const HostTensor& t, const std::string& stored) {
  return {name, stored, std::vector<int64_t>(t.shape.sizes().begin(), t.shape.sizes().end()), encode(t.values, stored)};
}

// A safetensors file read field by field: its header and each tensor's values.
struct HandFile {
  nlohmann::json header;
  std::map<std::string, HostTensor> tensors;
  std::map<std::string, std::string> dtypes;
  std::vector<std::string> data_order;  // tensors by their data offsets
};
inline HandFile read_by_hand(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  HandFile file;
  EXPECT_GE(all.size(), 8u) << path;
  uint64_t length = 0;
  std::memcpy(&length, all.data(), 8);
  file.header = nlohmann::json::parse(all.substr(8, length));
  const std::string data = all.substr(8 + length);
  std::vector<std::pair<uint64_t, std::string>> order;
  for (const auto& [name, entry] : file.header.items()) {
    if (name == "__metadata__") continue;
    const uint64_t begin = entry["data_offsets"][0], end = entry["data_offsets"][1];
    const std::string dtype = entry["dtype"];
    file.tensors[name] = {Shape(entry["shape"].get<std::vector<int64_t>>()),
                          decode(data.substr(begin, end - begin), dtype)};
    file.dtypes[name] = dtype;
    order.emplace_back(begin, name);
  }
  std::sort(order.begin(), order.end());
  for (const auto& entry : order) file.data_order.push_back(entry.second);
  return file;
}

// Named tensors as io::SafetensorsInput of `dtype` (`storage` keeps the bytes).
inline std::vector<io::SafetensorsInput> as_inputs(const NamedTensors& tensors, DType dtype,
                                                   std::vector<std::string>& storage,
                                                   const std::vector<std::pair<std::string, Shape>>& order) {
  storage.clear();
  storage.reserve(order.size());
  std::vector<io::SafetensorsInput> inputs;
  for (const auto& [name, shape] : order) {
    storage.push_back(encode(tensors.at(name).values, stored_name(dtype)));
    inputs.push_back({name, dtype, shape, storage.back().data()});
  }
  return inputs;
}

}  // namespace tessera::testing
