// Ranks started alike: the settings every rank must share, gathered and
// compared (see rank_agreement.h).
#include "apps/rank_agreement.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/context.h"
#include "core/error.h"

namespace tessera::app {
namespace {

using Settings = std::vector<std::pair<std::string, std::string>>;

Settings settings_to_agree(const TrainConfig& c, const std::optional<io::DatasetInfo>& data,
                           const std::optional<io::DatasetInfo>& eval) {
  static const std::set<std::string> may_differ = {"threads",   "device",  "config", "data",
                                                   "eval-data", "metrics", "trace"};
  Settings out;
  for (auto& [key, value] : settings(c))
    if (!may_differ.count(key)) out.emplace_back("--" + key, value);
  // What the files hold, and a digest of their values: two copies of the data
  // of the same size that differ are not the same data.
  if (data) out.emplace_back("the --data file's contents", data->describe() + ", " + io::dataset_digest(data->path));
  if (eval)
    out.emplace_back("the --eval-data file's contents", eval->describe() + ", " + io::dataset_digest(eval->path));
  out.emplace_back("the tessera build", TESSERA_VERSION);
  // One line per key and per value on the wire: a line break inside a value (a path) travels as "\n".
  for (auto& [key, value] : out) {
    std::string escaped;
    for (char ch : value) escaped += ch == '\n' ? std::string("\\n") : std::string(1, ch);
    value = escaped;
  }
  return out;
}

// "0", "0-2", "0-2, 5, 7-8"
std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!text.empty()) text += ", ";  // (appends: GCC 12 misreports `"-" + string` under -Wrestrict)
    text += std::to_string(ranks[i]);
    if (j > i) {
      text += '-';
      text += std::to_string(ranks[j]);
    }
    i = j + 1;
  }
  return text;
}

}  // namespace

void check_ranks_agree(parallel::Communicator& world, const TrainConfig& config,
                       const std::optional<io::DatasetInfo>& data, const std::optional<io::DatasetInfo>& eval) {
  if (world.size() == 1) return;
  const Settings mine = settings_to_agree(config, data, eval);
  std::string text;
  for (const auto& [key, value] : mine) text += key + '\n' + value + '\n';
  Context scratch;
  const std::vector<std::vector<uint8_t>> all =
      parallel::all_gather_bytes(world, scratch, std::vector<uint8_t>(text.begin(), text.end()));
  std::vector<std::map<std::string, std::string>> by_rank(all.size());  // per rank: key -> value
  for (size_t r = 0; r < all.size(); ++r) {
    std::istringstream in(std::string(all[r].begin(), all[r].end()));
    for (std::string key, value; std::getline(in, key) && std::getline(in, value);) by_rank[r][key] = value;
  }
  std::string differences;
  for (const auto& [key, ignored] : mine) {
    std::map<std::string, std::vector<int>> ranks_by_value;
    for (size_t r = 0; r < by_rank.size(); ++r) {
      const auto found = by_rank[r].find(key);
      ranks_by_value[found == by_rank[r].end() ? "(not set)" : found->second].push_back(int(r));
    }
    if (ranks_by_value.size() == 1) continue;
    // The values in the order of their lowest rank (rank 0's first), not of the text.
    std::vector<std::pair<std::string, std::vector<int>>> groups(ranks_by_value.begin(), ranks_by_value.end());
    std::sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) { return a.second[0] < b.second[0]; });
    differences += "\n  " + key + ":";
    for (const auto& [value, ranks] : groups)
      differences += " '" + value + (ranks.size() > 1 ? "' on ranks " : "' on rank ") + rank_list(ranks) + ";";
    differences.pop_back();
  }
  TESSERA_CHECK(differences.empty(), "the ", world.size(),
                " ranks were not started alike; every rank must get the same flags, data and tessera build "
                "(check the launch script, the --config file and the data on each node):",
                differences);
}

}  // namespace tessera::app
