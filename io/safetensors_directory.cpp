// Hugging Face model directories' weights (io/safetensors_directory.h): the
// shard plan of huggingface_hub's split_torch_state_dict_into_shards (what
// save_pretrained calls), the index through nlohmann::json, every shard
// opened and cross-checked against the index before a byte of data is read.
#include "io/safetensors_directory.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/units.h"

namespace tessera::io {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// "model-00002-of-00003.safetensors", transformers' shard name.
std::string shard_name(size_t index, size_t count) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in, "cannot open ", path, ": ", std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The index's weight_map as tensor → file name, every entry checked.
std::map<std::string, std::string> read_weight_map(const std::string& index) {
  const json parsed = json::parse(read_text(index), nullptr, false);
  const std::string fix = "; copy or download the model's directory again";
  TESSERA_CHECK(!parsed.is_discarded() && parsed.is_object(), index, " is not a JSON object", fix);
  TESSERA_CHECK(parsed.contains("weight_map") && parsed["weight_map"].is_object(), index,
                " has no object \"weight_map\" (tensor name → shard file)", fix);
  std::map<std::string, std::string> weight_map;
  for (const auto& [tensor, file] : parsed["weight_map"].items()) {
    TESSERA_CHECK(file.is_string(), index, ": \"weight_map\" maps tensor ", tensor, " to ", file.dump(),
                  ", not a file name", fix);
    const std::string name = file.get<std::string>();
    TESSERA_CHECK(!name.empty() && fs::path(name).filename() == name && name != "." && name != "..", index,
                  ": \"weight_map\" maps tensor ", tensor, " to '", name,
                  "', which is not the name of a file beside the index", fix);
    weight_map[tensor] = name;
  }
  TESSERA_CHECK(!weight_map.empty(), index, ": \"weight_map\" names no tensor", fix);
  return weight_map;
}

// What a directory without weights holds, for the message that refuses it.
std::string weights_found_instead(const std::string& directory) {
  std::vector<std::string> found;
  std::error_code error;
  for (fs::directory_iterator it(directory, error), end; !error && it != end; it.increment(error)) {
    const std::string extension = it->path().extension().string();
    if (extension == ".safetensors" || extension == ".bin" || extension == ".pt" || extension == ".pth")
      found.push_back(it->path().string());
  }
  if (found.empty()) return "";
  std::sort(found.begin(), found.end());
  return " (it holds " + human_list(found) +
         "; name one .safetensors file, or for PyTorch .bin files save the model again with save_pretrained(DIR), "
         "whose default is safetensors)";
}

}  // namespace

const char* torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return "bfloat16";
    case DType::f16:
      return "float16";
    default:
      return "float32";
  }
}

int64_t parse_shard_size(const std::string& text, const std::string& flag) {
  size_t digits = 0;
  while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.'))
    ++digits;
  std::string unit = text.substr(digits);
  for (char& c : unit) c = char(std::toupper(static_cast<unsigned char>(c)));
  const std::map<std::string, double> units = {
      {"", 1.0},    {"B", 1.0},      {"KB", 1e3},        {"MB", 1e6},           {"GB", 1e9},
      {"TB", 1e12}, {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  const auto multiplier = units.find(unit);
  double value = 0;
  bool number = digits > 0;
  try {
    size_t used = 0;
    if (number) value = std::stod(text.substr(0, digits), &used);
    number = number && used == digits;
  } catch (const std::exception&) {
    number = false;
  }
  TESSERA_CHECK(number && multiplier != units.end(), flag, " ", text,
                " is not a size: give a number of bytes or one with a unit, as transformers' max_shard_size: "
                "5GB, 500MB, 10KB (powers of 1000) or 2GiB, 512MiB (powers of 1024)");
  const double bytes = std::floor(value * multiplier->second);
  TESSERA_CHECK(bytes >= 1 && bytes < 9e18, flag, " ", text, " is ", bytes, " bytes; give a positive size below 9 EB");
  return int64_t(bytes);
}

ShardPlan plan_shards(const std::vector<int64_t>& tensor_bytes, int64_t max_shard_bytes) {
  TESSERA_CHECK(max_shard_bytes > 0, "plan_shards: the limit is ", max_shard_bytes, " bytes; it must be positive");
  // huggingface_hub's split_state_dict_into_shards_factory: in order; a tensor
  // above the limit in a shard of its own, appended when met; the open shard
  // appended when the next tensor would take it past the limit, and at the end.
  std::vector<std::vector<size_t>> shards;
  std::vector<size_t> current;
  int64_t current_bytes = 0;
  for (size_t i = 0; i < tensor_bytes.size(); ++i) {
    if (tensor_bytes[i] > max_shard_bytes) {
      shards.push_back({i});
      continue;
    }
    if (current_bytes + tensor_bytes[i] > max_shard_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(i);
    current_bytes += tensor_bytes[i];
  }
  if (!current.empty()) shards.push_back(std::move(current));
  ShardPlan plan;
  plan.file_of.resize(tensor_bytes.size());
  for (size_t s = 0; s < shards.size(); ++s)
    for (size_t i : shards[s]) plan.file_of[i] = int(s);
  const size_t count = std::max<size_t>(shards.size(), 1);
  for (size_t i = 0; i < count; ++i) plan.files.push_back(count == 1 ? kSafetensorsWeightsName : shard_name(i, count));
  return plan;
}
SafetensorsWritten write_safetensors_directory(const std::string& directory,
                                               const std::vector<SafetensorsInput>& tensors, int64_t max_shard_bytes,
                                               const std::map<std::string, std::string>& metadata) {
  std::vector<int64_t> sizes;
  for (const SafetensorsInput& tensor : tensors)
    sizes.push_back(tensor.shape.numel() * int64_t(dtype_size(tensor.dtype)));
  const ShardPlan plan = plan_shards(sizes, max_shard_bytes);
  std::map<std::string, std::string> file_metadata = metadata;
  file_metadata["format"] = "pt";
  SafetensorsWritten written;
  try {
    json weight_map = json::object();
    for (size_t f = 0; f < plan.files.size(); ++f) {
      std::vector<SafetensorsInput> in_file;
      for (size_t i = 0; i < tensors.size(); ++i)
        if (plan.file_of[i] == int(f)) {
          in_file.push_back(tensors[i]);
          weight_map[tensors[i].name] = plan.files[f];
          written.bytes += sizes[i];
        }
      const std::string path = (fs::path(directory) / plan.files[f]).string();
      write_safetensors(path, in_file, file_metadata);
      written.files.push_back(path);
    }
    if (plan.sharded()) {
      const std::string index = (fs::path(directory) / kSafetensorsIndexName).string();
      const json content = {{"metadata", {{"total_size", written.bytes}}}, {"weight_map", weight_map}};
      std::ofstream out(index, std::ios::trunc);
      written.files.push_back(index);
      out << content.dump(2) << "\n";  // as json.dumps(index, indent=2, sort_keys=True) + "\n"
      out.flush();
      TESSERA_CHECK(out, "cannot write ", index, ": ", std::strerror(errno));
    }
  } catch (...) {
    std::error_code ignored;
    for (const std::string& path : written.files) fs::remove(path, ignored);
    throw;
  }
  written.tensors = int64_t(tensors.size());
  return written;
}

SafetensorsDirectory::SafetensorsDirectory(const std::string& path, const std::string& flag) : path_(path) {
  std::error_code error;
  const std::string named = flag.empty() ? path : flag + " " + path;
  TESSERA_CHECK(fs::exists(path, error), named, " does not exist; name a model directory or a .safetensors file");
  if (!fs::is_directory(path, error)) {
    open_single(path);
    return;
  }
  const fs::path single = fs::path(path) / kSafetensorsWeightsName, index = fs::path(path) / kSafetensorsIndexName;
  if (fs::exists(single, error)) {
    open_single(single.string());
    return;
  }
  TESSERA_CHECK(fs::exists(index, error), named, " is a directory without a ", kSafetensorsWeightsName, " or ",
                kSafetensorsIndexName, weights_found_instead(path),
                "; name the directory save_pretrained(DIR) or `tessera export` wrote");
  open_sharded(index.string());
}

void SafetensorsDirectory::open_single(const std::string& file) {
  files_.emplace_back(file);
  const std::vector<SafetensorsEntry>& entries = files_.back().tensors();
  for (size_t e = 0; e < entries.size(); ++e) tensors_[entries[e].name] = {0, e};
}

void SafetensorsDirectory::open_sharded(const std::string& index) {
  index_ = index;
  const fs::path directory = fs::path(index).parent_path();
  const std::map<std::string, std::string> weight_map = read_weight_map(index);
  std::map<std::string, std::vector<std::string>> tensors_of;  // file → the index's tensors in it
  for (const auto& [tensor, file] : weight_map) tensors_of[file].push_back(tensor);
  std::error_code error;
  std::map<std::string, std::string> seen;  // every tensor of every shard → its shard
  for (const auto& [file, listed] : tensors_of) {
    const fs::path shard = directory / file;
    TESSERA_CHECK(fs::exists(shard, error), index, " maps ", listed.size(), " tensor", listed.size() == 1 ? "" : "s",
                  " (", listed.front(), listed.size() > 1 ? ", ..." : "", ") to ", file, ", but ", shard.string(),
                  " is missing; copy or download every shard the index names");
    files_.emplace_back(shard.string());
    for (const SafetensorsEntry& entry : files_.back().tensors()) {
      const auto [other, added] = seen.emplace(entry.name, shard.string());
      TESSERA_CHECK(added, "tensor ", entry.name, " is in two shards of ", path_, ": ", other->second, " and ",
                    shard.string(), "; the shards come from different saves: copy or download the directory again");
    }
    for (const std::string& tensor : listed) {
      const std::vector<SafetensorsEntry>& entries = files_.back().tensors();
      const auto found = std::find_if(entries.begin(), entries.end(),
                                      [&](const SafetensorsEntry& entry) { return entry.name == tensor; });
      TESSERA_CHECK(found != entries.end(), index, " maps tensor ", tensor, " to ", file, ", but ", shard.string(),
                    " has no tensor ", tensor,
                    "; the index and the shards do not belong together: copy or download the directory again");
      tensors_[tensor] = {files_.size() - 1, size_t(found - entries.begin())};  // the index decides what is there
    }
  }
}

SafetensorsDirectory::Located SafetensorsDirectory::find(const std::string& name) const {
  const auto found = tensors_.find(name);
  if (found == tensors_.end()) return {};
  const SafetensorsFile& file = files_[found->second.first];
  return {&file, &file.tensors()[found->second.second]};
}

std::vector<std::string> SafetensorsDirectory::names() const {
  std::vector<std::string> names;
  for (const auto& [name, where] : tensors_) names.push_back(name);
  return names;
}

std::string SafetensorsDirectory::describe() const {
  if (index_.empty()) return files_.front().path();
  return path_ + " (" + std::to_string(files_.size()) + " shard" + (files_.size() == 1 ? "" : "s") + " named by " +
         fs::path(index_).filename().string() + ")";
}

}  // namespace tessera::io
