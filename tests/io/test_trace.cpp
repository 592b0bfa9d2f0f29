// Per-rank Chrome traces (io/trace.h): the file parses as JSON (a test-local
// recursive parser, independent of io/'s flat reader) after close and after
// every flush, nested scopes nest, timestamps are monotonic and equal what an
// injected clock returned, ranks name their files and pids, threads get their
// own tids, and a null writer reads no clock and writes no file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "core/error.h"
#include "io/trace.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

class ScratchDir {
 public:
  ScratchDir() {
    std::random_device device;
    path_ = std::filesystem::temp_directory_path() /
            ("tessera_trace_test_" + std::to_string(getpid()) + "_" + std::to_string(device()));
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  size_t entries() const { return size_t(std::distance(std::filesystem::recursive_directory_iterator(path_), {})); }

 private:
  std::filesystem::path path_;
};

// --- a small, strict JSON parser (the whole grammar, nesting included) --------

struct Json;
using JsonObject = std::map<std::string, Json>;
using JsonArray = std::vector<Json>;
struct Json {
  std::variant<std::nullptr_t, bool, double, std::string, std::shared_ptr<JsonArray>, std::shared_ptr<JsonObject>>
      value;
  const JsonObject& object() const { return *std::get<std::shared_ptr<JsonObject>>(value); }
  const JsonArray& array() const { return *std::get<std::shared_ptr<JsonArray>>(value); }
  double number() const { return std::get<double>(value); }
  const std::string& string() const { return std::get<std::string>(value); }
  bool has(const std::string& key) const { return object().count(key) > 0; }
  const Json& operator[](const std::string& key) const { return object().at(key); }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : text_(text) {}
  Json document() {
    Json json = value();
    space();
    if (pos_ != text_.size()) throw std::runtime_error("trailing text at " + std::to_string(pos_));
    return json;
  }

 private:
  void space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  char next() {
    space();
    if (pos_ >= text_.size()) throw std::runtime_error("unexpected end");
    return text_[pos_];
  }
  void expect(char c) {
    if (next() != c) throw std::runtime_error(std::string("expected ") + c + " at " + std::to_string(pos_));
    ++pos_;
  }
  Json value() {
    const char c = next();
    if (c == '{') {
      auto object = std::make_shared<JsonObject>();
      ++pos_;
      if (next() == '}') {
        ++pos_;
        return Json{object};
      }
      for (;;) {
        const std::string key = string();
        expect(':');
        if (!object->emplace(key, value()).second) throw std::runtime_error("duplicate key " + key);
        if (next() == ',') {
          ++pos_;
          continue;
        }
        expect('}');
        return Json{object};
      }
    }
    if (c == '[') {
      auto array = std::make_shared<JsonArray>();
      ++pos_;
      if (next() == ']') {
        ++pos_;
        return Json{array};
      }
      for (;;) {
        array->push_back(value());
        if (next() == ',') {
          ++pos_;
          continue;
        }
        expect(']');
        return Json{array};
      }
    }
    if (c == '"') return Json{string()};
    for (const auto& [word, json] :
         {std::pair<std::string, Json>{"true", Json{true}}, {"false", Json{false}}, {"null", Json{nullptr}}}) {
      if (text_.compare(pos_, word.size(), word) == 0) {
        pos_ += word.size();
        return json;
      }
    }
    // -?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?
    static const std::regex number(R"(-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?)");
    std::smatch match;
    const std::string rest = text_.substr(pos_, 40);
    if (!std::regex_search(rest, match, number, std::regex_constants::match_continuous) || match.length(0) == 0)
      throw std::runtime_error("bad value at " + std::to_string(pos_));
    pos_ += size_t(match.length(0));
    return Json{std::stod(match.str(0))};
  }
  std::string string() {
    expect('"');
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      if (static_cast<unsigned char>(text_[pos_]) < 0x20) throw std::runtime_error("raw control character");
      if (text_[pos_] == '\\') {
        ++pos_;
        const char e = text_.at(pos_);
        if (e == 'u') {
          out += "?";
          pos_ += 4;
        } else {
          out += e == 'n' ? '\n' : e == 't' ? '\t' : e;
        }
        ++pos_;
      } else {
        out += text_[pos_++];
      }
    }
    expect('"');
    return out;
  }
  const std::string& text_;
  size_t pos_ = 0;
};

Json read_json(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return JsonParser(text.str()).document();
}

std::vector<Json> events_of(const Json& trace, const std::string& phase) {
  std::vector<Json> events;
  for (const Json& event : trace["traceEvents"].array())
    if (event["ph"].string() == phase) events.push_back(event);
  return events;
}

// A clock that advances by a random whole number of microseconds per read,
// and counts its reads.
struct FakeClock {
  explicit FakeClock(uint64_t seed) : rng(seed) {}
  int64_t read() {
    ++reads;
    now += 1000 * std::uniform_int_distribution<int64_t>(1, 50)(rng);
    history.push_back(now);
    return now;
  }
  std::mt19937_64 rng;
  int64_t now = 1'700'000'000'000'000'000;  // 2023, in ns
  int reads = 0;
  std::vector<int64_t> history;
};

TEST(TraceWriter, NestedScopesNestAndTimestampsAreTheClocks) {
  TESSERA_SEED_TRACE();
  ScratchDir dir;
  FakeClock clock(make_rng()());
  const std::string path = dir.file("trace.json");
  {
    io::TraceWriter trace({.path = path, .clock = [&] { return clock.read(); }});
    EXPECT_TRUE(trace.enabled());
    EXPECT_EQ(trace.path(), path);  // one rank: the name as given
    for (int step = 0; step < 3; ++step) {
      auto step_scope = trace.scope("step", "train");
      step_scope.arg("step", step);
      {
        auto forward = trace.scope("forward", "compute");
        { auto layer = trace.scope("layer \"0\"", "compute"); }
        { auto layer = trace.scope("layer 1", "compute"); }
      }
      auto backward = trace.scope("backward", "compute");
      backward.end();
      trace.counter("loss", 1.0 / (step + 1));
    }
  }
  EXPECT_EQ(clock.reads, 3 * (2 * 5 + 1));  // two reads per scope, one per counter

  const Json json = read_json(path);
  const auto complete = events_of(json, "X");
  ASSERT_EQ(complete.size(), 15u);
  // The clock's values, in microseconds: each event's start and end among them.
  std::vector<int64_t> micros;
  for (const int64_t ns : clock.history) micros.push_back(ns / 1000);
  double previous_ts = -1;
  for (const Json& event : complete) {
    EXPECT_EQ(event["pid"].number(), 0);
    EXPECT_EQ(event["tid"].number(), 0);
    EXPECT_TRUE(event.has("cat"));
    const auto ts = int64_t(event["ts"].number()), end = ts + int64_t(event["dur"].number());
    EXPECT_GE(event["ts"].number(), previous_ts) << "timestamps in file order";
    previous_ts = event["ts"].number();
    EXPECT_NE(std::find(micros.begin(), micros.end(), ts), micros.end());
    EXPECT_NE(std::find(micros.begin(), micros.end(), end), micros.end());
    EXPECT_GT(end, ts);
  }
  // Each step holds its forward, which holds both layers; backward follows forward.
  for (int step = 0; step < 3; ++step) {
    const Json& outer = complete[size_t(step) * 5];
    ASSERT_EQ(outer["name"].string(), "step");
    EXPECT_EQ(outer["args"]["step"].number(), step);
    const double outer_end = outer["ts"].number() + outer["dur"].number();
    for (size_t i = 1; i < 5; ++i) {
      const Json& inner = complete[size_t(step) * 5 + i];
      EXPECT_GE(inner["ts"].number(), outer["ts"].number());
      EXPECT_LE(inner["ts"].number() + inner["dur"].number(), outer_end);
    }
    const Json& forward = complete[size_t(step) * 5 + 1];
    EXPECT_EQ(forward["name"].string(), "forward");
    EXPECT_EQ(complete[size_t(step) * 5 + 2]["name"].string(), "layer \"0\"");
    EXPECT_LE(complete[size_t(step) * 5 + 3]["ts"].number() + complete[size_t(step) * 5 + 3]["dur"].number(),
              forward["ts"].number() + forward["dur"].number());
    EXPECT_EQ(complete[size_t(step) * 5 + 4]["name"].string(), "backward");
    EXPECT_GE(complete[size_t(step) * 5 + 4]["ts"].number(), forward["ts"].number() + forward["dur"].number());
  }
  const auto counters = events_of(json, "C");
  ASSERT_EQ(counters.size(), 3u);
  EXPECT_EQ(counters[2]["args"]["loss"].number(), 1.0 / 3);
  // The viewer's names for the process and thread.
  bool named = false;
  for (const Json& event : events_of(json, "M"))
    if (event["name"].string() == "process_name") named = event["args"]["name"].string() == "rank 0";
  EXPECT_TRUE(named);
}

TEST(TraceWriter, RealClockGivesUnixMicroseconds) {
  ScratchDir dir;
  const std::string path = dir.file("trace.json");
  const auto unix_us = [] {
    return double(
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count());
  };
  const double before = unix_us();
  {
    io::TraceWriter trace({.path = path});
    auto outer = trace.scope("outer");
    { auto inner = trace.scope("inner"); }
  }
  const double after = unix_us();
  const auto complete = events_of(read_json(path), "X");
  ASSERT_EQ(complete.size(), 2u);
  EXPECT_EQ(complete[0]["name"].string(), "outer");
  for (const Json& event : complete) {
    EXPECT_GE(event["ts"].number(), before - 1000);  // the offset is taken once at open, within a millisecond
    EXPECT_LE(event["ts"].number() + event["dur"].number(), after + 1000);
    EXPECT_GE(event["dur"].number(), 0);
  }
  EXPECT_LE(complete[0]["ts"].number(), complete[1]["ts"].number());
  EXPECT_GE(complete[0]["ts"].number() + complete[0]["dur"].number(),
            complete[1]["ts"].number() + complete[1]["dur"].number());
}

TEST(TraceWriter, NullWriterReadsNoClockAndWritesNothing) {
  ScratchDir dir;
  int reads = 0;
  {
    io::TraceWriter off({.path = "", .clock = [&] { return int64_t(++reads); }});
    EXPECT_FALSE(off.enabled());
    for (int i = 0; i < 100; ++i) {
      auto scope = off.scope("forward", "compute");
      scope.arg("bytes", 1.0);
    }
    off.counter("loss", 1.0);
    off.complete("comm", "mpi", 0, 10);
    off.set_thread_name("main");
    off.flush();
    EXPECT_EQ(off.now_ns(), 0);
  }
  EXPECT_EQ(reads, 0);
  io::TraceWriter default_off;
  { auto scope = default_off.scope("x"); }
  default_off.close();
  EXPECT_EQ(dir.entries(), 0u);
}

TEST(TraceWriter, RanksNameTheirFiles) {
  EXPECT_EQ(io::trace_path_for_rank("trace.json", 0, 1), "trace.json");
  EXPECT_EQ(io::trace_path_for_rank("trace.json", 3, 4), "trace.rank3.json");
  EXPECT_EQ(io::trace_path_for_rank("out/run.v2/trace.json", 0, 2), "out/run.v2/trace.rank0.json");
  EXPECT_EQ(io::trace_path_for_rank("out/run.v2/trace", 1, 2), "out/run.v2/trace.rank1");

  ScratchDir dir;
  {
    io::TraceWriter trace({.path = dir.file("traces/t.json"), .rank = 2, .world_size = 4});
    EXPECT_EQ(trace.path(), dir.file("traces/t.rank2.json"));
    { auto scope = trace.scope("forward"); }
  }
  const auto complete = events_of(read_json(dir.file("traces/t.rank2.json")), "X");
  ASSERT_EQ(complete.size(), 1u);
  EXPECT_EQ(complete[0]["pid"].number(), 2);
  EXPECT_FALSE(std::filesystem::exists(dir.file("traces/t.json")));

  EXPECT_THROW(io::TraceWriter({.path = dir.file("t.json"), .rank = 4, .world_size = 4}), Error);
}

TEST(TraceWriter, FileIsCompleteJsonAfterEveryFlush) {
  ScratchDir dir;
  const std::string path = dir.file("trace.json");
  io::TraceWriter trace({.path = path, .flush_every = 4});
  EXPECT_EQ(events_of(read_json(path), "X").size(), 0u);  // the header alone is a document
  size_t recorded = 0;
  for (int i = 0; i < 11; ++i) {
    { auto scope = trace.scope("op " + std::to_string(i)); }
    ++recorded;
    // 3 metadata events start the buffer: an automatic flush when it holds 4.
    const size_t on_disk = events_of(read_json(path), "X").size();
    EXPECT_LE(on_disk, recorded);
    EXPECT_GE(on_disk + 4, recorded);
  }
  trace.flush();
  EXPECT_EQ(events_of(read_json(path), "X").size(), 11u);
  { auto scope = trace.scope("after flush"); }
  trace.close();
  EXPECT_EQ(events_of(read_json(path), "X").size(), 12u);
  { auto scope = trace.scope("after close"); }  // recorded nowhere, no error
  EXPECT_EQ(events_of(read_json(path), "X").size(), 12u);
}

TEST(TraceWriter, ThreadsGetTheirOwnTid) {
  ScratchDir dir;
  const std::string path = dir.file("trace.json");
  {
    io::TraceWriter trace({.path = path});
    std::thread worker([&] {
      trace.set_thread_name("loader");
      for (int i = 0; i < 20; ++i) {
        auto scope = trace.scope("load", "io");
      }
    });
    for (int i = 0; i < 20; ++i) {
      auto scope = trace.scope("compute", "compute");
    }
    worker.join();
    const int64_t start = trace.now_ns();
    trace.complete("allreduce", "comm", start, start + 5000);
  }
  const Json json = read_json(path);
  std::map<std::string, std::set<double>> tids;
  for (const Json& event : events_of(json, "X")) tids[event["name"].string()].insert(event["tid"].number());
  ASSERT_EQ(tids["load"].size(), 1u);
  ASSERT_EQ(tids["compute"].size(), 1u);
  EXPECT_EQ(*tids["compute"].begin(), 0);
  EXPECT_NE(*tids["load"].begin(), *tids["compute"].begin());
  bool loader_named = false;
  for (const Json& event : events_of(json, "M"))
    if (event["name"].string() == "thread_name" && event["args"]["name"].string() == "loader")
      loader_named = event["tid"].number() == *tids["load"].begin();
  EXPECT_TRUE(loader_named);
  const auto complete = events_of(json, "X");
  const auto allreduce =
      std::find_if(complete.begin(), complete.end(), [](const Json& e) { return e["name"].string() == "allreduce"; });
  ASSERT_NE(allreduce, complete.end());
  EXPECT_EQ((*allreduce)["dur"].number(), 5);
}

TEST(TraceWriter, UnwritablePathNamesTheFile) {
  ScratchDir dir;
  const std::string blocker = dir.file("plain_file");
  std::ofstream(blocker) << "x";
  try {
    io::TraceWriter trace({.path = blocker + "/trace.json"});
    FAIL() << "no throw";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("plain_file"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace tessera::testing
