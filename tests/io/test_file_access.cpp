// Files this process may not read: a data file or checkpoint that exists but
// is unreadable (mode 000, or in a directory this user cannot search) is
// reported with what the operating system said ("Permission denied"), the
// file's owner and mode and this process's user, never as "truncated,
// corrupt, or not HDF5". Root reads anything, so the readers run in a forked
// child that becomes the unprivileged user 65534 (nobody) first.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <random>
#include <string>

#include "core/context.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "io/dataset.h"
#include "parallel/local_communicator.h"
#include "tests/io/io_test_files.h"
#include "tests/support/test_support.h"

namespace tessera::testing {
namespace {

constexpr uid_t kOtherUser = 65534;  // nobody
constexpr gid_t kOtherGroup = 65534;

// The tessera::Error text `read` throws when run as another user than the
// file's owner (in a child process); "" when it throws nothing.
std::string error_as_another_user(const std::function<void()>& read) {
  int channel[2];
  if (::pipe(channel) != 0) return "pipe failed";
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(channel[0]);
    std::string text;
    if (::geteuid() == 0 && (::setgid(kOtherGroup) != 0 || ::setuid(kOtherUser) != 0)) {
      text = "cannot become uid 65534";
    } else {
      try {
        read();
      } catch (const Error& error) {
        text = error.what();
      } catch (const std::exception& error) {
        text = std::string("not a tessera::Error: ") + error.what();
      }
    }
    (void)!::write(channel[1], text.data(), text.size());
    ::_exit(0);
  }
  ::close(channel[1]);
  std::string text;
  char buffer[4096];
  for (ssize_t n; (n = ::read(channel[0], buffer, sizeof buffer)) > 0;) text.append(buffer, size_t(n));
  ::close(channel[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  return text;
}

std::vector<int32_t> random_tokens(std::mt19937_64& rng, size_t count, int32_t vocab) {
  std::uniform_int_distribution<int32_t> id(0, vocab - 1);
  std::vector<int32_t> tokens(count);
  for (auto& t : tokens) t = id(rng);
  return tokens;
}

void expect_contains(const std::string& text, const std::vector<std::string>& parts) {
  for (const std::string& part : parts)
    EXPECT_NE(text.find(part), std::string::npos) << "missing '" << part << "' in: " << text;
}

TEST(FileAccess, AnUnreadableDataFileIsReportedAsPermissionDenied) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  std::filesystem::permissions(dir.path(), std::filesystem::perms(0755));
  const std::string path = dir.file("tokens.h5");
  write_tokens(path, random_tokens(rng, 300, 40), H5T_STD_U8LE, 40);
  ::chmod(path.c_str(), 0000);
  const std::string text = error_as_another_user([&] { io::inspect_dataset(path); });
  expect_contains(text, {path, "Permission denied", "mode 0000", "this process runs as uid 65534"});
  EXPECT_EQ(text.find("corrupt"), std::string::npos) << text;
  EXPECT_EQ(text.find("does not exist"), std::string::npos) << text;
}

TEST(FileAccess, ADirectoryThisUserCannotSearchIsNamed) {
  TESSERA_SEED_TRACE();
  auto rng = make_rng();
  TempDir dir;
  const std::filesystem::path inner = std::filesystem::path(dir.path()) / "private";
  std::filesystem::create_directory(inner);
  std::filesystem::permissions(dir.path(), std::filesystem::perms(0755));
  std::filesystem::permissions(inner, std::filesystem::perms(0700));
  const std::string path = (inner / "tokens.h5").string();
  write_tokens(path, random_tokens(rng, 300, 40), H5T_STD_U8LE, 40);
  const std::string text = error_as_another_user([&] { io::TokenData reader(path); });
  expect_contains(text, {path, "Permission denied", "directory " + inner.string() + " cannot be searched"});
  EXPECT_EQ(text.find("does not exist"), std::string::npos) << text;
}

TEST(FileAccess, AnUnreadableCheckpointIsReportedAsPermissionDenied) {
  TempDir dir;
  std::filesystem::permissions(dir.path(), std::filesystem::perms(0755));
  Context ctx;
  auto world = parallel::make_local_communicator("world");
  io::TensorPiece piece;
  piece.name = "w";
  piece.global_shape = Shape{4};
  piece.dtype = DType::f32;
  piece.local = ctx.full(Shape{4}, DType::f32, 1.5);
  const std::string saved = io::save_checkpoint(*world, dir.file("save"), 3, {piece}, {});
  const std::string file = saved + "/checkpoint.h5";
  ::chmod(file.c_str(), 0000);
  const std::string text = error_as_another_user([&] { io::CheckpointReader reader(saved); });
  expect_contains(text, {file, "Permission denied", "this process runs as uid 65534"});
  EXPECT_EQ(text.find("corrupt"), std::string::npos) << text;
}

}  // namespace
}  // namespace tessera::testing
