// Running the `tessera` program as a test would run a job: under mpiexec,
// in its own process group with its output in a log file, waited for with a
// deadline after which the whole group is killed (nothing can hang a test),
// plus small helpers for argument lists, output and TESSERA_FAULT. Header-only, shared by
// the multi-process checkpoint tests, the fault tests and the CLI tests;
// tessera_command and run_training need the test target to define
// TESSERA_BINARY and TESSERA_MPIEXEC.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace tessera::testing {

using Clock = std::chrono::steady_clock;
using std::chrono::seconds;

// The environment of a test job: this process's, less the variables `drop`
// picks (none when it is empty), plus what every job gets (Open MPI allowed
// to run as root, one OpenMP thread, progress as lines), plus `extra`.
inline std::vector<std::string> job_environment(const std::function<bool(const std::string&)>& drop = {},
                                                const std::vector<std::string>& extra = {}) {
  std::vector<std::string> environment;
  for (char** entry = environ; *entry; ++entry)
    if (!drop || !drop(*entry)) environment.emplace_back(*entry);
  for (const char* fixed : {"OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1", "OMP_NUM_THREADS=1",
                            "TESSERA_PROGRESS=lines"})
    environment.emplace_back(fixed);
  environment.insert(environment.end(), extra.begin(), extra.end());
  return environment;
}

// A process (mpiexec and the ranks it starts) in its own process group, its
// output going to a log file.
class Job {
 public:
  // `environment`: the job's variables (job_environment() unless told).
  Job(const std::vector<std::string>& argv, const std::string& log,
      const std::vector<std::string>& environment = job_environment())
      : log_(log) {
    std::vector<char*> args, env;
    for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
    args.push_back(nullptr);
    for (const std::string& entry : environment) env.push_back(const_cast<char*>(entry.c_str()));
    env.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    posix_spawnattr_t attributes;
    posix_spawnattr_init(&attributes);
    posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attributes, 0);
    const int error = posix_spawn(&pid_, args[0], &actions, &attributes, args.data(), env.data());
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attributes);
    if (error != 0) {
      ADD_FAILURE() << "cannot start " << argv[0] << ": " << std::strerror(error);
      pid_ = -1;
    }
  }
  ~Job() {
    if (pid_ > 0 && !done_) kill_all();
  }
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  pid_t pid() const { return pid_; }
  bool running() {
    if (pid_ <= 0 || done_) return false;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) finish(status);
    return !done_;
  }
  // The exit status (128 + signal when killed), or -1 after killing it at the deadline.
  int wait(seconds limit) {
    const auto deadline = Clock::now() + limit;
    while (running() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (running()) {
      ADD_FAILURE() << "still running after " << limit.count() << " s; killed. Its output:\n" << output();
      kill_all();
      return -1;
    }
    return status_;
  }
  // Whether any process of the job's process group (mpiexec and its ranks) is still there.
  bool anything_left() const { return pid_ > 0 && ::kill(-pid_, 0) == 0; }
  std::string output() const {
    std::ifstream in(log_);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

 private:
  void finish(int status) {
    done_ = true;
    status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  void kill_all() {
    ::kill(-pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    done_ = true;
    status_ = -1;
  }

  std::string log_;
  pid_t pid_ = -1;
  bool done_ = false;
  int status_ = -1;
};

// A loopback port nothing listens on now (bound to 0, read back, closed):
// a server the test starts binds it next.
inline int free_port() {
  const int probe = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  const bool ok = ::bind(probe, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
                  ::getsockname(probe, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  ::close(probe);
  return ok ? ntohs(address.sin_port) : 0;
}

// How a job ended: {status, seconds, output, anything left running}.
struct Outcome {
  int status = 0;  // as Job::wait: -1 when killed at the deadline
  double seconds = 0.0;
  std::string output;
  bool left = false;  // processes of the job still there after it ended
};

// Runs `argv` (a job: mpiexec and its ranks, maybe under a wrapper) to its end (bounded by `limit`).
inline Outcome run_command(const std::vector<std::string>& argv, const std::string& log, seconds limit,
                           const std::vector<std::string>& environment = job_environment()) {
  const auto start = Clock::now();
  Job job(argv, log, environment);
  Outcome out;
  out.status = job.wait(limit);
  out.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  out.left = job.anything_left();
  out.output = job.output();
  return out;
}

// Waits until the metrics file `metrics` holds `count` step records while `job` runs.
inline bool wait_for_steps(Job& job, const std::string& metrics, int count, seconds limit) {
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline && job.running()) {
    std::ifstream in(metrics);
    int lines = 0;
    for (std::string line; std::getline(in, line);) lines += line.find("\"step\"") != std::string::npos;
    if (lines >= count) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

// Waits until `job`'s output holds every one of `parts` (true), or it ended
// or `limit` passed (false).
inline bool wait_for_output(Job& job, const std::vector<std::string>& parts, seconds limit) {
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline && job.running()) {
    const std::string output = job.output();
    bool all = true;
    for (const std::string& part : parts) all = all && output.find(part) != std::string::npos;
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// TESSERA_FAULT (core/fault.h) for the jobs a test starts while this lives.
struct FaultEnvironment {
  explicit FaultEnvironment(const std::string& value) { ::setenv("TESSERA_FAULT", value.c_str(), 1); }
  ~FaultEnvironment() { ::unsetenv("TESSERA_FAULT"); }
  FaultEnvironment(const FaultEnvironment&) = delete;
  FaultEnvironment& operator=(const FaultEnvironment&) = delete;
};

// tessera_command and run_training: for test targets that define TESSERA_BINARY and TESSERA_MPIEXEC.
#ifdef TESSERA_BINARY
inline std::vector<std::string> tessera_command(int ranks, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {TESSERA_MPIEXEC, "-np",  std::to_string(ranks), "--oversubscribe",
                                   "--bind-to",     "none", TESSERA_BINARY,        "train"};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

// Runs `tessera train args` on `ranks` ranks to the end; fails the test
// (printing the output) unless it exits 0. Returns the output.
inline std::string run_training(int ranks, const std::vector<std::string>& args, const std::string& log) {
  Job job(tessera_command(ranks, args), log);
  const int status = job.wait(seconds(90));
  EXPECT_EQ(status, 0) << "tessera train on " << ranks << " rank(s) failed; its output:\n" << job.output();
  return job.output();
}
#endif  // TESSERA_BINARY

// `argv` as one shell word each ('...' quoted), for `sh -c` command lines.
inline std::string shell_words(const std::vector<std::string>& argv) {
  std::string line;
  for (const std::string& arg : argv) {
    std::string quoted = "'";
    for (char ch : arg) quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
    line += (line.empty() ? "" : " ") + quoted + "'";
  }
  return line;
}

inline std::vector<std::string> joined(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

inline std::string step_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return name;
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// "--a 1 --b 2" as {"--a", "1", "--b", "2"}.
inline std::vector<std::string> words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> out;
  for (std::string word; in >> word;) out.push_back(word);
  return out;
}

}  // namespace tessera::testing
