#include "core/file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <random>
#include <utility>
#include <vector>

#include "core/check.h"

namespace flashlm {

std::string errno_text(int err) { return std::strerror(err); }

ReadOnlyFile::ReadOnlyFile(std::string path, std::string_view owner) : path_(std::move(path)), owner_(owner) {
  // O_NONBLOCK makes open() return at once on a FIFO with no writer; fstat then tells what was opened, on the
  // descriptor itself, so nothing can be swapped in between the check and the reads.
  fd_ = ::open(path_.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  FLASHLM_CHECK(fd_ >= 0, "{}: '{}': cannot open: {}", owner_, path_, errno_text(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    fail("{}: '{}': cannot stat: {}", owner_, path_, errno_text(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    fail("{}: '{}': not a regular file ({})", owner_, path_,
         S_ISDIR(st.st_mode)    ? "a directory"
         : S_ISFIFO(st.st_mode) ? "a FIFO"
         : S_ISSOCK(st.st_mode) ? "a socket"
                                : "a device");
  }
  size_ = static_cast<uint64_t>(st.st_size);
}

ReadOnlyFile::ReadOnlyFile(ReadOnlyFile&& o) noexcept
    : path_(std::move(o.path_)), owner_(std::move(o.owner_)), fd_(std::exchange(o.fd_, -1)), size_(o.size_) {}

ReadOnlyFile& ReadOnlyFile::operator=(ReadOnlyFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    owner_ = std::move(o.owner_);
    fd_ = std::exchange(o.fd_, -1);
    size_ = o.size_;
  }
  return *this;
}

ReadOnlyFile::~ReadOnlyFile() {
  if (fd_ >= 0) ::close(fd_);
}

void ReadOnlyFile::read_at(uint64_t offset, std::span<std::byte> out) const {
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t got = ::pread(fd_, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail("{}: '{}': cannot read {} bytes at offset {}: {}", owner_, path_, out.size(), offset, errno_text(errno));
    if (got == 0) {
      struct stat st {};
      const long long now = ::fstat(fd_, &st) == 0 ? static_cast<long long>(st.st_size) : -1;
      fail("{}: '{}': bytes [{}, {}) are past its end: it has {} bytes now, {} when it was opened (was it truncated "
           "or rewritten while in use?)",
           owner_, path_, offset, offset + out.size(), now, size_);
    }
    done += static_cast<size_t>(got);
  }
}

std::string temporary_path(const std::string& path) {
  static std::mt19937_64 rng{std::random_device{}()};
  static std::mutex mutex;
  const std::lock_guard lock(mutex);
  return fmt::format("{}.tmp.{}.{:016x}", path, ::getpid(), rng());
}

void remove_stale_temporaries(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const std::string prefix = p.filename().string() + ".tmp.";
  std::error_code ec;
  for (fs::directory_iterator it(p.parent_path().empty() ? fs::path(".") : p.parent_path(), ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with(prefix)) continue;
    long long pid = 0;
    const char* digits = name.c_str() + prefix.size();
    const auto [rest, err] = std::from_chars(digits, name.c_str() + name.size(), pid);
    if (err != std::errc() || *rest != '.' || pid <= 0 || pid > std::numeric_limits<pid_t>::max()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) ::unlink(it->path().c_str());
  }
}

void write_files_together(std::span<const FileToWrite> files, std::string_view owner) {
  std::vector<std::string> tmps;
  const auto remove_all = [&] {
    for (const std::string& t : tmps) ::unlink(t.c_str());
  };
  try {
    for (const FileToWrite& file : files) {
      const std::string& tmp = tmps.emplace_back(temporary_path(file.path));
      // O_EXCL: the name is this writer's alone, never a file (or a link) someone left there.
      const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NONBLOCK | O_CLOEXEC, 0644);
      FLASHLM_CHECK(fd >= 0, "{}: cannot open '{}' for writing: {}", owner, tmp, errno_text(errno));
      bool fd_open = true;
      try {
        for (std::span<const std::byte> part : file.parts) {
          while (!part.empty()) {
            const ssize_t put = ::write(fd, part.data(), part.size());
            if (put < 0 && errno == EINTR) continue;
            FLASHLM_CHECK(put > 0, "{}: failed writing '{}': {}", owner, tmp, errno_text(errno));
            part = part.subspan(static_cast<size_t>(put));
          }
        }
        // On the disk before the rename, or a crash could leave the new name pointing at missing data.
        FLASHLM_CHECK(::fsync(fd) == 0, "{}: cannot flush '{}': {}", owner, tmp, errno_text(errno));
        fd_open = false;
        FLASHLM_CHECK(::close(fd) == 0, "{}: failed writing '{}': {}", owner, tmp, errno_text(errno));
      } catch (...) {
        if (fd_open) ::close(fd);
        throw;
      }
    }
  } catch (...) {
    remove_all();
    throw;
  }
  for (size_t i = 0; i < files.size(); ++i) {
    if (std::rename(tmps[i].c_str(), files[i].path.c_str()) != 0) {
      const int err = errno;
      remove_all();
      fail("{}: cannot rename '{}' to '{}': {}", owner, tmps[i], files[i].path, errno_text(err));
    }
  }
}

void write_file_atomically(const std::string& path, std::span<const std::span<const std::byte>> parts,
                           std::string_view owner) {
  const FileToWrite file{path, parts};
  write_files_together(std::span(&file, 1), owner);
}

}  // namespace flashlm
