// The byte-level BPE tokenizer (io/tokenizer.h): pre-tokenization by GPT-2's
// pattern through PCRE2, training with pair counts updated only in the chunks
// a merge touches, GPT-2's merge order when encoding, Hugging Face's
// vocab.json / merges.txt, and the /tokenizer group of token datasets.
#include "io/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/hdf5_file.h"

namespace tessera::io {

// GPT-2's pre-tokenization pattern, compiled once per tokenizer (shared by its copies).
class ChunkPattern {
 public:
  ChunkPattern() {
    static constexpr char kPattern[] = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kPattern), PCRE2_ZERO_TERMINATED,
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
    TESSERA_CHECK(code_ != nullptr, "PCRE2 cannot compile GPT-2's pre-tokenization pattern: ", message(error),
                  " (at offset ", offset, "); is libpcre2-8 built with Unicode support?");
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // optional: pcre2_match interprets when JIT is unavailable
  }
  ~ChunkPattern() { pcre2_code_free(code_); }
  ChunkPattern(const ChunkPattern&) = delete;
  ChunkPattern& operator=(const ChunkPattern&) = delete;

  // Calls `visit` with each chunk of `text` in order; together they are the
  // whole text. Bytes the pattern cannot match (invalid UTF-8) are chunks of
  // their own, one per run.
  template <typename Visit>
  void split(std::string_view text, Visit&& visit) const {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match(
        pcre2_match_data_create_from_pattern(code_, nullptr), pcre2_match_data_free);
    TESSERA_CHECK(match != nullptr, "PCRE2 cannot allocate match data (out of memory)");
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t at = 0;
    while (at < text.size()) {
      const int status = pcre2_match(code_, subject, text.size(), at, 0, match.get(), nullptr);
      if (status == PCRE2_ERROR_NOMATCH) {
        visit(text.substr(at));
        return;
      }
      TESSERA_CHECK(status > 0, "PCRE2 failed pre-tokenizing at byte ", at, ": ", message(status));
      const PCRE2_SIZE* range = pcre2_get_ovector_pointer(match.get());
      TESSERA_CHECK(range[1] > range[0] && range[0] >= at, "PCRE2 returned an empty match at byte ", at);
      if (range[0] > at) visit(text.substr(at, range[0] - at));
      visit(text.substr(range[0], range[1] - range[0]));
      at = range[1];
    }
  }

 private:
  static std::string message(int code) {
    PCRE2_UCHAR buffer[256];
    return pcre2_get_error_message(code, buffer, sizeof buffer) < 0 ? "error " + std::to_string(code)
                                                                    : reinterpret_cast<const char*>(buffer);
  }
  pcre2_code* code_ = nullptr;
};

namespace {

using Merge = Tokenizer::Merge;

uint64_t pair_key(int32_t left, int32_t right) {
  return uint64_t(uint32_t(left)) << 32 | uint32_t(right);
}

// ---- GPT-2's bytes_to_unicode() --------------------------------------------

bool prints_as_itself(int byte) {
  return (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
}

// The code point spelling each byte, and the byte of each code point below 256 + 68 (-1: none).
struct Gpt2Alphabet {
  std::array<char32_t, 256> code_of{};
  std::array<int, 256 + 68> byte_of{};
  Gpt2Alphabet() {
    byte_of.fill(-1);
    char32_t next = 256;
    for (int byte = 0; byte < 256; ++byte) {
      code_of[size_t(byte)] = prints_as_itself(byte) ? char32_t(byte) : next++;
      byte_of[code_of[size_t(byte)]] = byte;
    }
  }
};

void append_utf8(std::string& out, char32_t code) {
  if (code < 0x80) {
    out += char(code);
  } else {  // every code point of the alphabet is below U+0800
    out += char(0xC0 | (code >> 6));
    out += char(0x80 | (code & 0x3F));
  }
}

std::string gpt2_spelling(const Gpt2Alphabet& alphabet, std::string_view bytes) {
  std::string out;
  for (char byte : bytes) append_utf8(out, alphabet.code_of[uint8_t(byte)]);
  return out;
}

// Text shown in a message: at most 40 bytes of it.
std::string shown(std::string_view text) {
  std::string out(1, '"');
  out.append(text.substr(0, 40));
  out.append(text.size() > 40 ? "...\"" : "\"");
  return out;
}

// The bytes a GPT-2 spelling stands for; nothing when it holds a character
// outside the alphabet (or is not UTF-8), whose position `bad` then tells.
std::optional<std::string> gpt2_bytes(const Gpt2Alphabet& alphabet, std::string_view text, size_t& bad) {
  std::string out;
  for (size_t at = 0; at < text.size();) {
    const auto lead = uint8_t(text[at]);
    char32_t code = lead;
    size_t length = 1;
    if (lead >= 0xC0 && lead < 0xE0 && at + 1 < text.size() && (uint8_t(text[at + 1]) & 0xC0) == 0x80) {
      code = char32_t(lead & 0x1F) << 6 | (uint8_t(text[at + 1]) & 0x3F);
      length = 2;
    } else if (lead >= 0x80) {
      code = 0xFFFF;  // a longer or broken sequence: outside the alphabet either way
    }
    if (code >= alphabet.byte_of.size() || alphabet.byte_of[code] < 0) {
      bad = at;
      return std::nullopt;
    }
    out += char(alphabet.byte_of[code]);
    at += length;
  }
  return out;
}

// ---- training -------------------------------------------------------------

// A distinct chunk of the corpus as token ids, and how often it occurs.
struct Word {
  std::vector<int32_t> ids;
  int64_t count = 0;
};

// Pair counts over all words, kept current as merges rewrite the words that
// hold the merged pair (found through `where_`), and a queue of candidates
// whose stored counts may be stale (a pair's count only falls once it
// exists: a pair with the new token arises only in the merge that makes it).
class PairCounts {
 public:
  explicit PairCounts(std::vector<Word> words) : words_(std::move(words)) {
    for (int32_t w = 0; w < int32_t(words_.size()); ++w) add_pairs(w, +1, nullptr);
    for (const auto& [pair, count] : counts_) queue_.push({count, pair});
  }

  // The most frequent pair (ties: the smallest (left, right)) and its count;
  // count 0 when no pair is left.
  std::pair<uint64_t, int64_t> most_frequent() {
    while (!queue_.empty()) {
      const Candidate top = queue_.top();
      const auto found = counts_.find(top.pair);
      const int64_t current = found == counts_.end() ? 0 : found->second;
      if (current == top.count) return {top.pair, top.count};
      queue_.pop();
      if (current > 0) queue_.push({current, top.pair});
    }
    return {0, 0};
  }

  // Replaces every occurrence of `pair` (left to right, not overlapping) by `merged`.
  void merge(uint64_t pair, int32_t merged) {
    const auto left = int32_t(pair >> 32), right = int32_t(uint32_t(pair));
    std::vector<int32_t> holders = std::move(where_[pair]);
    where_.erase(pair);
    std::sort(holders.begin(), holders.end());
    holders.erase(std::unique(holders.begin(), holders.end()), holders.end());
    std::vector<uint64_t> born;  // pairs with `merged`, new in this step
    for (int32_t w : holders) {
      std::vector<int32_t>& ids = words_[size_t(w)].ids;
      if (!holds(ids, left, right)) continue;  // an earlier merge took its last occurrence
      add_pairs(w, -1, nullptr);
      size_t out = 0;
      for (size_t i = 0; i < ids.size(); ++i) {
        const bool here = i + 1 < ids.size() && ids[i] == left && ids[i + 1] == right;
        ids[out++] = here ? merged : ids[i];
        i += here;
      }
      ids.resize(out);
      add_pairs(w, +1, &born);
    }
    for (uint64_t key : born) queue_.push({counts_[key], key});
  }

 private:
  struct Candidate {
    int64_t count;
    uint64_t pair;
    bool operator<(const Candidate& other) const {  // the queue's top: most frequent, then smallest pair
      return count < other.count || (count == other.count && pair > other.pair);
    }
  };

  static bool holds(const std::vector<int32_t>& ids, int32_t left, int32_t right) {
    for (size_t i = 0; i + 1 < ids.size(); ++i)
      if (ids[i] == left && ids[i + 1] == right) return true;
    return false;
  }

  // Adds (sign +1) or removes (-1) the word's pairs; on adding with `born`,
  // pairs with the newest token are indexed and listed there.
  void add_pairs(int32_t w, int sign, std::vector<uint64_t>* born) {
    const Word& word = words_[size_t(w)];
    const int32_t newest = born ? *std::max_element(word.ids.begin(), word.ids.end()) : -1;
    for (size_t i = 0; i + 1 < word.ids.size(); ++i) {
      const uint64_t key = pair_key(word.ids[i], word.ids[i + 1]);
      int64_t& count = counts_[key];
      count += sign * word.count;
      if (count == 0) counts_.erase(key);
      if (sign < 0 || (born && word.ids[i] != newest && word.ids[i + 1] != newest)) continue;
      std::vector<int32_t>& list = where_[key];
      if (!list.empty() && list.back() == w) continue;
      if (born && list.empty()) born->push_back(key);
      list.push_back(w);
    }
  }

  std::vector<Word> words_;
  std::unordered_map<uint64_t, int64_t> counts_;
  std::unordered_map<uint64_t, std::vector<int32_t>> where_;  // words that hold (or held) each pair
  std::priority_queue<Candidate> queue_;
};

std::vector<std::string> byte_tokens() {
  std::vector<std::string> tokens;
  for (int byte = 0; byte < 256; ++byte) tokens.emplace_back(1, char(byte));
  return tokens;
}

std::string read_text_file(const std::string& path, const char* what) {
  check_readable_file(path, what, "check the path");
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in, "cannot open ", what, " ", path, ": ", std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  TESSERA_CHECK(!in.bad(), "cannot read ", what, " ", path, ": ", std::strerror(errno));
  return text.str();
}

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  TESSERA_CHECK(out, "cannot create ", path, ": ", std::strerror(errno));
  out.write(text.data(), std::streamsize(text.size()));
  out.flush();
  TESSERA_CHECK(out, "writing ", path, " failed: ", std::strerror(errno));
}

}  // namespace

// ---- construction ------------------------------------------------------------

Tokenizer::Tokenizer(std::vector<std::string> tokens, std::vector<Merge> merges, const Site& token_site,
                     const Site& merge_site)
    : tokens_(std::move(tokens)), merges_(std::move(merges)), pattern_(std::make_shared<const ChunkPattern>()) {
  const int64_t vocab = vocab_size();
  TESSERA_CHECK(vocab >= 256 && vocab <= kMaxVocabSize, token_site(-1), " holds ", vocab,
                " tokens; a byte-level vocabulary holds from 256 to 2^20");
  std::unordered_map<std::string_view, int32_t> ids;
  for (int32_t id = 0; id < int32_t(vocab); ++id) {
    const std::string& token = tokens_[size_t(id)];
    TESSERA_CHECK(!token.empty(), token_site(id), " is empty; every token holds at least one byte");
    const auto [at, fresh] = ids.emplace(token, id);
    TESSERA_CHECK(fresh, token_site(id), " spells the same bytes as token ", at->second,
                  "; each token must be distinct");
  }
  for (int byte = 0; byte < 256; ++byte) {
    const char single = char(byte);
    const auto at = ids.find(std::string_view(&single, 1));
    TESSERA_CHECK(at != ids.end(), token_site(-1), " has no token for the byte 0x", "0123456789abcdef"[byte >> 4],
                  "0123456789abcdef"[byte & 15], "; a byte-level vocabulary holds all 256 single bytes");
    byte_ids_[byte] = at->second;
  }
  for (int32_t rank = 0; rank < int32_t(merges_.size()); ++rank) {
    const Merge merge = merges_[size_t(rank)];
    TESSERA_CHECK(merge.left >= 0 && merge.left < vocab && merge.right >= 0 && merge.right < vocab, merge_site(rank),
                  ": merge (", merge.left, ", ", merge.right, ") names a token id outside [0, ", vocab, ")");
    const auto merged = ids.find(tokens_[size_t(merge.left)] + tokens_[size_t(merge.right)]);
    TESSERA_CHECK(merged != ids.end(), merge_site(rank), ": merge (", merge.left, ", ", merge.right,
                  ") makes the token ", shown(tokens_[size_t(merge.left)] + tokens_[size_t(merge.right)]),
                  ", which is not in the vocabulary");
    const auto [at, fresh] = rules_.emplace(pair_key(merge.left, merge.right), MergeRule{rank, merged->second});
    TESSERA_CHECK(fresh, merge_site(rank), ": merge (", merge.left, ", ", merge.right, ") repeats merge ",
                  at->second.rank, "; each pair is merged once");
  }
}

Tokenizer Tokenizer::bytes() {
  const Site site = [](int64_t) { return std::string("the byte tokenizer"); };
  return Tokenizer(byte_tokens(), {}, site, site);
}

bool Tokenizer::is_bytes() const {
  if (vocab_size() != 256 || !merges_.empty()) return false;
  for (int byte = 0; byte < 256; ++byte)
    if (byte_ids_[byte] != byte) return false;
  return true;
}

std::string Tokenizer::describe() const {
  return is_bytes() ? "bytes" : "BPE (" + std::to_string(merges_.size()) + " merges)";
}

const std::string& Tokenizer::token_text(int32_t id) const {
  TESSERA_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " is outside the tokenizer's vocabulary [0, ",
                vocab_size(), "); was the data made with another tokenizer?");
  return tokens_[size_t(id)];
}

// ---- training ---------------------------------------------------------------

BpeTraining Tokenizer::train_bpe(std::string_view text, int64_t vocab_size, const TokenizerProgress& progress) {
  TESSERA_CHECK(vocab_size >= 256 && vocab_size <= kMaxVocabSize, "BPE training: the vocabulary size is ", vocab_size,
                "; give one in [256, 2^20] (256 bytes, then one token per merge)");
  BpeTraining result{bytes(), {}};
  std::unordered_map<std::string_view, int64_t> chunk_counts;
  result.tokenizer.pattern_->split(text, [&](std::string_view chunk) { ++chunk_counts[chunk]; });
  std::vector<Word> words;
  for (const auto& [chunk, count] : chunk_counts) {
    if (chunk.size() < 2) continue;  // no pair to count
    Word word{{}, count};
    for (char byte : chunk) word.ids.push_back(uint8_t(byte));
    words.push_back(std::move(word));
  }
  PairCounts counts(std::move(words));
  std::vector<std::string> tokens = byte_tokens();
  std::vector<Merge> merges;
  const int64_t wanted = vocab_size - 256;
  while (int64_t(merges.size()) < wanted) {
    const auto [pair, count] = counts.most_frequent();
    if (count < 2) {
      result.note = "BPE training stopped after " + std::to_string(merges.size()) + " of " + std::to_string(wanted) +
                    " merges (vocabulary " + std::to_string(tokens.size()) + " instead of " +
                    std::to_string(vocab_size) + "): no pair of adjacent tokens occurs twice in the text";
      break;
    }
    const Merge merge{int32_t(pair >> 32), int32_t(uint32_t(pair))};
    counts.merge(pair, int32_t(tokens.size()));
    tokens.push_back(tokens[size_t(merge.left)] + tokens[size_t(merge.right)]);
    merges.push_back(merge);
    if (progress) progress(int64_t(merges.size()), wanted);
  }
  const Site site = [](int64_t) { return std::string("BPE training"); };
  result.tokenizer = Tokenizer(std::move(tokens), std::move(merges), site, site);
  return result;
}

// ---- encoding and decoding ------------------------------------------------------

void Tokenizer::encode_chunk(std::string_view chunk, std::vector<int32_t>& out) const {
  constexpr size_t kNone = SIZE_MAX;
  const size_t n = chunk.size();
  std::vector<int32_t> ids(n);
  std::vector<size_t> next(n), previous(n);  // the tokens as a linked list over their first bytes
  std::vector<bool> gone(n, false);          // merged into the token before
  for (size_t i = 0; i < n; ++i) {
    ids[i] = byte_ids_[uint8_t(chunk[i])];
    next[i] = i + 1;
    previous[i] = i == 0 ? kNone : i - 1;
  }
  // The rule merging the token at i with its successor, if any.
  const auto rule_at = [&](size_t i) -> const MergeRule* {
    if (i == kNone || next[i] >= n) return nullptr;
    const auto found = rules_.find(pair_key(ids[i], ids[next[i]]));
    return found == rules_.end() ? nullptr : &found->second;
  };
  // Rounds as in GPT-2: the lowest-ranked pair present, all its occurrences
  // left to right; a pair that a round creates with a lower rank waits for
  // the next round (only merge lists not in training order have such pairs).
  using Entry = std::pair<int32_t, size_t>;  // (rank, position of the left token)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> queue;
  std::vector<Entry> deferred;
  for (size_t i = 0; i + 1 < n; ++i)
    if (const MergeRule* rule = rule_at(i)) queue.push({rule->rank, i});
  int32_t round = -1;
  while (!queue.empty() || !deferred.empty()) {
    if (queue.empty() || queue.top().first > round) {
      for (const Entry& entry : deferred) queue.push(entry);
      deferred.clear();
      round = queue.top().first;
    }
    const auto [rank, i] = queue.top();
    queue.pop();
    const MergeRule* rule = gone[i] ? nullptr : rule_at(i);
    if (!rule || rule->rank != rank) continue;  // stale: the pair changed since
    const size_t j = next[i];
    ids[i] = rule->result;
    gone[j] = true;
    next[i] = next[j];
    if (next[j] < n) previous[next[j]] = i;
    for (const size_t left : {previous[i], i}) {
      const MergeRule* fresh = rule_at(left);
      if (!fresh) continue;
      if (fresh->rank < round)
        deferred.push_back({fresh->rank, left});
      else
        queue.push({fresh->rank, left});
    }
  }
  for (size_t i = 0; i < n; i = next[i]) out.push_back(ids[i]);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, const TokenizerProgress& progress) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3);
  constexpr int64_t kReportEvery = int64_t(1) << 20;  // bytes between progress calls
  int64_t done = 0, reported = 0;
  std::unordered_map<std::string_view, std::pair<size_t, size_t>> seen;  // chunk -> its ids' range in `out`
  pattern_->split(text, [&](std::string_view chunk) {
    const auto [at, fresh] = seen.try_emplace(chunk, out.size(), 0);
    if (fresh) {
      encode_chunk(chunk, out);
      at->second.second = out.size() - at->second.first;
    } else {  // a copy of the ids of its first occurrence (resized first: `out` may move)
      const auto [first, count] = at->second;
      out.resize(out.size() + count);
      std::copy_n(out.begin() + std::ptrdiff_t(first), count, out.end() - std::ptrdiff_t(count));
    }
    done += int64_t(chunk.size());
    if (progress && done - reported >= kReportEvery) progress(reported = done, int64_t(text.size()));
  });
  if (progress) progress(int64_t(text.size()), int64_t(text.size()));
  return out;
}

std::vector<std::string_view> Tokenizer::pretokenize(std::string_view text) const {
  std::vector<std::string_view> chunks;
  pattern_->split(text, [&](std::string_view chunk) { chunks.push_back(chunk); });
  return chunks;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (const int32_t id : ids) out += token_text(id);
  return out;
}

// ---- Hugging Face GPT-2 files -------------------------------------------------------

namespace {

// Each line of `text` (a final line break ends the last line), without a trailing '\r'.
std::vector<std::string_view> lines_of(std::string_view text) {
  std::vector<std::string_view> lines;
  while (!text.empty()) {
    const size_t end = std::min(text.find('\n'), text.size());
    std::string_view line = text.substr(0, end);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    lines.push_back(line);
    text.remove_prefix(std::min(end + 1, text.size()));
  }
  return lines;
}

// vocab.json as token bytes by id.
std::vector<std::string> parse_gpt2_vocab(const Gpt2Alphabet& alphabet, std::string_view text,
                                          const std::string& name) {
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& error) {
    TESSERA_THROW(name, " is not valid JSON: ", error.what());
  }
  TESSERA_CHECK(vocab.is_object(), name, " holds a JSON ", vocab.type_name(),
                "; a GPT-2 vocabulary is an object of token -> id");
  const auto size = int64_t(vocab.size());
  TESSERA_CHECK(size >= 256 && size <= kMaxVocabSize, name, " has ", size,
                " entries; a byte-level vocabulary holds from 256 (the bytes) to 2^20");
  std::vector<std::string> tokens(static_cast<size_t>(size));
  std::vector<bool> filled(static_cast<size_t>(size), false);
  for (const auto& [spelling, id] : vocab.items()) {
    TESSERA_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < size, name, ": entry ",
                  shown(spelling), " has id ", id.dump(), "; ids are the integers 0..", size - 1, " (one per entry)");
    const auto index = size_t(id.get<int64_t>());
    TESSERA_CHECK(!filled[index], name, ": id ", index, " is given to two entries, ", shown(spelling), " and ",
                  shown(gpt2_spelling(alphabet, tokens[index])), "; each id names one token");
    size_t bad = 0;
    const std::optional<std::string> bytes = gpt2_bytes(alphabet, spelling, bad);
    TESSERA_CHECK(bytes.has_value(), name, ": entry ", shown(spelling), " (id ", index, ") has a character at byte ",
                  bad, " that is not one of GPT-2's 256 byte characters (bytes_to_unicode)");
    tokens[index] = *bytes;
    filled[index] = true;
  }
  return tokens;  // no gaps: `size` distinct ids below `size`
}

// merges.txt as id pairs; `lines` gets the line number of each merge.
std::vector<Merge> parse_gpt2_merges(const Gpt2Alphabet& alphabet, std::string_view text, const std::string& name,
                                     const std::vector<std::string>& tokens, std::vector<int64_t>& lines) {
  std::unordered_map<std::string_view, int32_t> ids;
  for (size_t id = 0; id < tokens.size(); ++id) ids.emplace(tokens[id], int32_t(id));
  const std::vector<std::string_view> all = lines_of(text);
  std::vector<Merge> merges;
  for (size_t index = 0; index < all.size(); ++index) {
    const std::string_view line = all[index];
    const int64_t number = int64_t(index) + 1;
    if (index == 0 && line.starts_with("#version")) continue;
    const size_t space = line.find(' ');
    TESSERA_CHECK(space != std::string_view::npos && space > 0 && space + 1 < line.size() &&
                      line.find(' ', space + 1) == std::string_view::npos,
                  name, " line ", number, ": ", shown(line),
                  " is not two tokens separated by one space (\"left right\")");
    Merge merge;
    for (const bool right : {false, true}) {
      const std::string_view part = right ? line.substr(space + 1) : line.substr(0, space);
      size_t bad = 0;
      const std::optional<std::string> bytes = gpt2_bytes(alphabet, part, bad);
      TESSERA_CHECK(bytes.has_value(), name, " line ", number, ": ", shown(part), " has a character at byte ", bad,
                    " that is not one of GPT-2's 256 byte characters (bytes_to_unicode)");
      const auto found = ids.find(*bytes);
      TESSERA_CHECK(found != ids.end(), name, " line ", number, ": token ", shown(part),
                    " is not in the vocabulary; are vocab.json and merges.txt from the same tokenizer?");
      (right ? merge.right : merge.left) = found->second;
    }
    merges.push_back(merge);
    lines.push_back(number);
  }
  return merges;
}

}  // namespace

Tokenizer Tokenizer::from_gpt2_files(const std::string& vocab_json, const std::string& merges_txt) {
  const std::string vocab = read_text_file(vocab_json, "vocabulary file (--vocab)");
  return from_gpt2_text(vocab, read_text_file(merges_txt, "merges file (--merges)"), vocab_json, merges_txt);
}

Tokenizer Tokenizer::from_gpt2_text(std::string_view vocab_json, std::string_view merges_txt,
                                    const std::string& vocab_name, const std::string& merges_name) {
  const Gpt2Alphabet alphabet;
  std::vector<std::string> tokens = parse_gpt2_vocab(alphabet, vocab_json, vocab_name);
  std::vector<int64_t> lines;
  std::vector<Merge> merges = parse_gpt2_merges(alphabet, merges_txt, merges_name, tokens, lines);
  const std::vector<std::string> spellings = [&] {
    std::vector<std::string> out;
    for (const std::string& token : tokens) out.push_back(gpt2_spelling(alphabet, token));
    return out;
  }();
  const Site token_site = [&](int64_t id) {
    return id < 0 ? vocab_name
                  : vocab_name + ": entry " + shown(spellings[size_t(id)]) + " (id " + std::to_string(id) + ")";
  };
  const Site merge_site = [&](int64_t rank) { return merges_name + " line " + std::to_string(lines[size_t(rank)]); };
  return Tokenizer(std::move(tokens), std::move(merges), token_site, merge_site);
}

void Tokenizer::write_gpt2_files(const std::string& vocab_json, const std::string& merges_txt) const {
  const Gpt2Alphabet alphabet;
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (size_t id = 0; id < tokens_.size(); ++id) vocab[gpt2_spelling(alphabet, tokens_[id])] = id;
  write_text_file(vocab_json, vocab.dump(-1, ' ', false) + "\n");
  std::string merges = "#version: 0.2\n";
  for (const Merge& merge : merges_)
    merges += gpt2_spelling(alphabet, tokens_[size_t(merge.left)]) + " " +
              gpt2_spelling(alphabet, tokens_[size_t(merge.right)]) + "\n";
  write_text_file(merges_txt, merges);
}

// ---- the /tokenizer group of a dataset ----------------------------------------------

namespace {

constexpr char kGroup[] = "tokenizer";
constexpr int64_t kMaxTokenBytes = int64_t(1) << 26;  // all tokens' bytes together: 64 per token of 2^20

bool has_group(hid_t file, const char* name) {
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  Hdf5QuietErrors quiet;
  if (H5Lexists(file, name, H5P_DEFAULT) <= 0) {
    H5Eclear2(H5E_DEFAULT);
    return false;
  }
  return true;
}

// A 1-D or [rows, 2] integer dataset of the group, checked and read whole.
template <typename T>
std::vector<T> read_group_dataset(const std::string& path, hid_t group, const char* name, hid_t memory_type,
                                  int64_t columns, int64_t max_rows, const char* layout) {
  const std::string where = path + ": dataset '/tokenizer/" + name + "'";
  TESSERA_CHECK(has_dataset(group, name), where, " is missing; it must be ", layout,
                " (prepare the file again with `tessera prepare text --tokenizer bpe`)");
  Hdf5Handle dataset = dataset_handle(TESSERA_HDF5_CHECK_AT(path, H5Dopen2(group, name, H5P_DEFAULT)));
  Hdf5Handle type = datatype_handle(TESSERA_HDF5_CHECK_AT(path, H5Dget_type(dataset.get())));
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  TESSERA_CHECK(H5Tget_class(type.get()) == H5T_INTEGER, where, " is not an integer dataset; it must be ", layout);
  const std::vector<int64_t> dims = dataset_dims(path, dataset.get());
  const bool shaped = columns == 1 ? dims.size() == 1 : dims.size() == 2 && dims[1] == columns;
  TESSERA_CHECK(shaped, where, " has ", dims.size(), " dimension(s) (shape [", dims.empty() ? 0 : dims[0],
                dims.size() > 1 ? ", ..." : "", "]); it must be ", layout);
  TESSERA_CHECK(dims[0] <= max_rows, where, " has ", dims[0], " rows, more than the ", max_rows,
                " a tokenizer holds; the file is damaged");
  TESSERA_CHECK(all_elements_stored(path, dataset.get()), where,
                " has no data stored for some of its elements (an interrupted writer?); prepare the file again");
  std::vector<T> values(size_t(dims[0] * columns));
  read_rows(path, dataset.get(), 0, dims[0], memory_type, values.data());
  return values;
}

// Token bytes by id from the concatenated bytes and the offsets, every offset checked.
std::vector<std::string> split_tokens(const std::string& path, const std::vector<uint8_t>& bytes,
                                      const std::vector<int64_t>& offsets) {
  const std::string where = path + ": dataset '/tokenizer/token_offsets'";
  TESSERA_CHECK(offsets.size() >= 257, where, " holds ", offsets.size(),
                " offsets; a vocabulary of V >= 256 tokens needs V + 1");
  TESSERA_CHECK(offsets.front() == 0 && offsets.back() == int64_t(bytes.size()), where, " runs from ", offsets.front(),
                " to ", offsets.back(), "; it must run from 0 to the ", bytes.size(),
                " bytes of '/tokenizer/token_bytes'");
  std::vector<std::string> tokens;
  for (size_t id = 0; id + 1 < offsets.size(); ++id) {
    TESSERA_CHECK(offsets[id] < offsets[id + 1] && offsets[id + 1] <= int64_t(bytes.size()), where, ": entries ", id,
                  " and ", id + 1, " (", offsets[id], ", ", offsets[id + 1], ") do not rise inside [0, ", bytes.size(),
                  "]: token ", id, " would be empty or outside '/tokenizer/token_bytes'");
    tokens.emplace_back(bytes.begin() + offsets[id], bytes.begin() + offsets[id + 1]);
  }
  return tokens;
}

}  // namespace

void Tokenizer::save(const std::string& h5_path) const {
  const Hdf5Serial serial;  // calls outside TESSERA_HDF5_CHECK (io/hdf5_threads.h)
  Hdf5QuietErrors quiet;
  const hid_t opened = H5Fopen(h5_path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  TESSERA_CHECK(opened >= 0, "cannot open ", h5_path, " to store the tokenizer: ", tessera::detail::hdf5_error_stack());
  Hdf5Handle file = file_handle(opened);
  Hdf5Handle group(
      TESSERA_HDF5_CHECK_AT(h5_path, H5Gcreate2(file.get(), kGroup, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)), H5Gclose);
  write_string_attribute(h5_path, group.get(), "kind", "bpe");
  std::string bytes;
  std::vector<int64_t> offsets{0};
  for (const std::string& token : tokens_) offsets.push_back(int64_t((bytes += token).size()));
  std::vector<int32_t> pairs;
  for (const Merge& merge : merges_) pairs.insert(pairs.end(), {merge.left, merge.right});
  const int64_t byte_shape[] = {int64_t(bytes.size())}, offset_shape[] = {int64_t(offsets.size())},
                merge_shape[] = {int64_t(merges_.size()), 2};
  Hdf5Handle data = create_dataset(h5_path, group.get(), "token_bytes", H5T_STD_U8LE, byte_shape);
  write_rows(h5_path, data.get(), 0, byte_shape[0], H5T_NATIVE_UINT8, bytes.data());
  data = create_dataset(h5_path, group.get(), "token_offsets", H5T_STD_I64LE, offset_shape);
  write_rows(h5_path, data.get(), 0, offset_shape[0], H5T_NATIVE_INT64, offsets.data());
  data = create_dataset(h5_path, group.get(), "merges", H5T_STD_I32LE, merge_shape);
  write_rows(h5_path, data.get(), 0, merge_shape[0], H5T_NATIVE_INT32, pairs.data());
  data.reset();
  TESSERA_HDF5_CHECK_AT(h5_path, H5Fflush(file.get(), H5F_SCOPE_GLOBAL));
}

std::optional<Tokenizer> Tokenizer::for_model_data(const std::string& h5_path, int64_t vocab_size) {
  std::optional<Tokenizer> tokenizer = load(h5_path);
  if (!tokenizer && vocab_size == 256) tokenizer = bytes();
  if (tokenizer)
    TESSERA_CHECK(tokenizer->vocab_size() <= vocab_size, "the tokenizer of ", h5_path, " has ", tokenizer->vocab_size(),
                  " tokens, more than the model's vocabulary of ", vocab_size,
                  "; use the tokenizer of the data the model was trained on");
  return tokenizer;
}

Tokenizer Tokenizer::of_dataset(const std::string& h5_path, int64_t vocab_size, const std::string& flag) {
  const std::string give = "; give the dataset (.h5) `tessera prepare text` made of the model's training data";
  std::error_code error;
  TESSERA_CHECK(std::filesystem::exists(h5_path, error), flag, " ", h5_path, " does not exist", give);
  TESSERA_CHECK(!is_checkpoint(h5_path), flag, " ", h5_path, " is a checkpoint, not a dataset", give);
  TESSERA_CHECK(!std::filesystem::is_directory(h5_path, error), flag, " ", h5_path, " is a directory, not a dataset",
                give);
  TESSERA_CHECK(is_hdf5_file(h5_path), flag, " ", h5_path, " is not an HDF5 file, so not a dataset", give);
  std::optional<Tokenizer> tokenizer = for_model_data(h5_path, vocab_size);
  TESSERA_CHECK(tokenizer.has_value(), flag, " ", h5_path, " stores no tokenizer, and the model's vocabulary is ",
                vocab_size,
                ", not the 256 bytes of `prepare text`'s default; give a dataset of `prepare text "
                "--tokenizer bpe` with this vocabulary");
  return std::move(*tokenizer);
}

std::optional<Tokenizer> Tokenizer::load(const std::string& h5_path) {
  Hdf5QuietErrors quiet;
  Hdf5Handle file = open_hdf5_read(h5_path);
  if (!has_group(file.get(), kGroup)) return std::nullopt;
  const std::string where = h5_path + ": group '/tokenizer'";
  const hid_t opened = (Hdf5Serial(), H5Gopen2(file.get(), kGroup, H5P_DEFAULT));
  TESSERA_CHECK(opened >= 0, where, " cannot be opened as a group (is it a dataset?); prepare the file again");
  Hdf5Handle group(opened, H5Gclose);
  TESSERA_CHECK(has_attribute(group.get(), "kind"), where, " lacks its attribute 'kind' (\"bpe\")");
  const std::string kind = read_string_attribute(h5_path, group.get(), "kind");
  TESSERA_CHECK(kind == "bpe", where, " has kind \"", kind, "\"; this build reads \"bpe\" tokenizers");
  const auto offsets = read_group_dataset<int64_t>(h5_path, group.get(), "token_offsets", H5T_NATIVE_INT64, 1,
                                                   kMaxVocabSize + 1, "int64 [V + 1]");
  const auto bytes = read_group_dataset<uint8_t>(h5_path, group.get(), "token_bytes", H5T_NATIVE_UINT8, 1,
                                                 kMaxTokenBytes, "uint8 [all tokens' bytes]");
  const auto pairs =
      read_group_dataset<int32_t>(h5_path, group.get(), "merges", H5T_NATIVE_INT32, 2, kMaxVocabSize, "int32 [M, 2]");
  std::vector<Merge> merges;
  for (size_t i = 0; i < pairs.size(); i += 2) merges.push_back({pairs[i], pairs[i + 1]});
  const Site token_site = [&](int64_t id) {
    return id < 0 ? h5_path + ": the tokenizer ('/tokenizer/token_offsets')"
                  : h5_path + ": dataset '/tokenizer/token_offsets': token " + std::to_string(id);
  };
  const Site merge_site = [&](int64_t row) {
    return h5_path + ": dataset '/tokenizer/merges' row " + std::to_string(row);
  };
  return Tokenizer(split_tokens(h5_path, bytes, offsets), std::move(merges), token_site, merge_site);
}

}  // namespace tessera::io
