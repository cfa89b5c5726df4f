// Reading files that other processes may change: a file opened here is never a FIFO or a device (open()
// on a FIFO blocks until a writer comes, forever when none does), and it is read with pread() at explicit
// offsets, so a file that shrinks while it is open gives a short read, which is an error naming the file,
// instead of the SIGBUS that touching a truncated memory mapping raises.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace flashlm {

std::string errno_text(int err);  // strerror(err)

class ReadOnlyFile {
 public:
  // Opens `path` for reading, without blocking, and refuses anything but a regular file. `owner` starts
  // every error message ("TokenFile", "checkpoint"), followed by the quoted path.
  ReadOnlyFile(std::string path, std::string_view owner);
  ReadOnlyFile(ReadOnlyFile&& o) noexcept;
  ReadOnlyFile& operator=(ReadOnlyFile&& o) noexcept;
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;
  ~ReadOnlyFile();

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }  // when it was opened

  // Reads exactly out.size() bytes from `offset`; a file that ends sooner (truncated since it was opened,
  // or a size the caller did not check) is a flashlm::Error naming the file, the range and the size now.
  void read_at(uint64_t offset, std::span<std::byte> out) const;

 private:
  std::string path_, owner_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// A name for a temporary beside `path` that no other writer uses: path + ".tmp.<pid>.<random>", so that two
// processes writing one path never write or rename each other's file.
std::string temporary_path(const std::string& path);

// Removes the temporaries of `path` (temporary_path's names) left by writers that were killed: those whose
// process is gone. Never fails; a temporary it cannot remove stays, and is ignored by every writer.
void remove_stale_temporaries(const std::string& path);

// One file of a set written together: its path and its bytes, `parts` one after the other.
struct FileToWrite {
  std::string path;
  std::span<const std::span<const std::byte>> parts;
};

// Writes each file to a temporary beside it (temporary_path) and flushes it to the disk; only when all are
// written are they renamed over their paths, so that a failure to write any of them (a full disk) leaves every
// old file as it was, a reader never sees half a file, and no temporary is left behind. `owner` starts every error message, as
// for ReadOnlyFile.
void write_files_together(std::span<const FileToWrite> files, std::string_view owner);

// write_files_together for one file.
void write_file_atomically(const std::string& path, std::span<const std::span<const std::byte>> parts,
                           std::string_view owner);

}  // namespace flashlm
