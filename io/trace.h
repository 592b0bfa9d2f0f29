// Per-rank timelines in the Chrome trace / Perfetto JSON format: complete
// events ("ph":"X": name, cat, ts and dur in microseconds, pid = rank, tid =
// thread) recorded by RAII scopes, plus counters. Open the file in
// https://ui.perfetto.dev or chrome://tracing. Timestamps are Unix-epoch
// microseconds (a steady clock offset from the wall clock at open), so the
// files of different ranks line up when merged.
//
//   io::TraceWriter trace({.path = "trace.json", .rank = rank, .world_size = world});  // trace.rank3.json
//   { auto s = trace.scope("forward", "compute"); ... }   // one event, nested scopes nest
//
// A TraceWriter with no path is a null writer: scope() reads no clock, takes
// no lock and allocates nothing. Events are buffered and appended to the file
// every `flush_every` events, on flush() and at close; after each of those the
// file is complete, valid JSON.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace tessera::io {

// The file a rank writes: "trace.json" stays as it is for a single rank and
// becomes "trace.rank3.json" when world_size > 1 (".rank3" is appended when
// the name has no extension).
std::string trace_path_for_rank(const std::string& path, int rank, int world_size);

struct TraceOptions {
  std::string path{};  // empty: tracing off (a null writer)
  int rank = 0;        // the events' pid; names the file when world_size > 1
  int world_size = 1;
  size_t flush_every = 8192;  // buffered events that trigger an append to the file
  // Nanoseconds since the Unix epoch; empty: the steady clock offset from the
  // wall clock at open. Tests pass their own.
  std::function<int64_t()> clock{};
};

class TraceWriter {
 public:
  class Scope;

  // A null writer: records nothing, writes nothing.
  TraceWriter() = default;
  // With a path: opens the rank's file (creating parent directories) and
  // writes the header; throws tessera::Error naming the file when it cannot.
  explicit TraceWriter(TraceOptions options);
  // close(); an error there is printed to stderr (destructors do not throw).
  ~TraceWriter();
  // Scopes point at their writer: it stays where it was made.
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;

  bool enabled() const { return file_ != nullptr; }
  const std::string& path() const { return path_; }  // the rank's file; empty when off

  // An event from now until the scope ends (its destructor or end()).
  [[nodiscard]] Scope scope(std::string_view name, std::string_view category = {});
  // An event measured elsewhere: [start_ns, end_ns] on this writer's clock (now_ns()).
  void complete(std::string_view name, std::string_view category, int64_t start_ns, int64_t end_ns);
  // A counter sample ("ph":"C"): Perfetto draws a track of its values.
  void counter(std::string_view name, double value);
  // Names the calling thread in the viewer ("loader", "comm").
  void set_thread_name(std::string_view name);
  // Nanoseconds since the Unix epoch on this writer's clock; 0 for a null writer.
  int64_t now_ns() const;

  // Appends the buffered events; the file is complete JSON afterwards.
  void flush();
  // Flushes and closes the file; later calls record nothing. Throws on I/O
  // errors. Call it (or let the destructor run) after other threads stop tracing.
  void close();

  class Scope {
   public:
    Scope() = default;
    Scope(Scope&& other) noexcept { *this = std::move(other); }
    Scope& operator=(Scope&& other) noexcept;
    ~Scope() { end(); }
    // A numeric argument shown with the event ("bytes", "micro_batch").
    Scope& arg(std::string_view key, double value);
    // Ends the event now (the destructor then does nothing).
    void end();

   private:
    friend class TraceWriter;
    TraceWriter* writer_ = nullptr;
    int64_t start_ns_ = 0;
    std::string name_, category_;
    std::vector<std::pair<std::string, double>> args_;
  };

 private:
  struct Event {
    char phase;  // 'X' complete, 'C' counter, 'M' metadata
    std::string name, category;
    int64_t start_ns = 0, end_ns = 0;
    int tid = 0;
    std::vector<std::pair<std::string, double>> args;
    std::string label;  // metadata events: the process or thread name
  };
  struct FileCloser {
    void operator()(std::FILE* file) const { std::fclose(file); }
  };

  void record(Event event);
  int thread_index();     // with mutex_ held
  void write_buffered();  // with mutex_ held
  std::string event_json(const Event& event) const;

  TraceOptions options_;
  std::string path_;
  std::unique_ptr<std::FILE, FileCloser> file_;
  // The default clock: wall time at open plus steady time since then.
  int64_t wall_origin_ns_ = 0;
  std::chrono::steady_clock::time_point steady_origin_;
  mutable std::mutex mutex_;
  std::vector<Event> buffer_;
  std::vector<std::thread::id> threads_;  // index = tid
  bool wrote_event_ = false;
  std::string deferred_error_;  // a failed automatic flush, reported by flush() or close()
};

}  // namespace tessera::io
