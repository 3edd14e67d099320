// SafetensorsWriter: the header is fixed by the declared entries, so the file
// is written front to back in one pass with bounded memory (one staging
// buffer), whatever the size of the tensors.
#include <weightsync/error.h>
#include <weightsync/safetensors.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <set>

#include <fcntl.h>
#include <unistd.h>

namespace weightsync {
namespace {

// Small writes are gathered into this much memory before reaching the OS;
// larger ones go straight through.
constexpr size_t kStagingBytes = size_t(4) << 20;
// Direct I/O: offsets, lengths and memory aligned to this (every block
// device's logical block divides it), copied through a bounce buffer of
// kBounceBytes where the memory is not.
constexpr uint64_t kDirectAlign = 4096;
constexpr size_t kBounceBytes = size_t(4) << 20;

uint64_t entry_bytes(const SafetensorsWriter::Entry& e, const std::string& path) {
  // Same rule as the reader: the product of the non-zero dims fits in int64.
  uint64_t elements = 1;
  bool empty = false;
  for (int64_t d : e.shape) {
    if (d < 0)
      fail(Errc::invalid_argument, path, ": tensor '", e.name, "' has a negative dim in shape ",
           shape_str(e.shape));
    empty = empty || d == 0;
    if (d != 0 && (__builtin_mul_overflow(elements, uint64_t(d), &elements) ||
                   elements > uint64_t(INT64_MAX)))
      fail(Errc::invalid_argument, path, ": tensor '", e.name, "' shape ", shape_str(e.shape),
           " overflows 64 bits");
  }
  uint64_t bytes = 0;
  if (empty) return 0;
  if (__builtin_mul_overflow(elements, itemsize(e.dtype), &bytes))
    fail(Errc::invalid_argument, path, ": tensor '", e.name, "' shape ", shape_str(e.shape),
         " overflows 64 bits in bytes");
  return bytes;
}

}  // namespace

struct SafetensorsWriter::Impl {
  std::string path, tmp_path;
  int fd = -1;
  std::vector<Entry> entries;
  std::vector<uint64_t> ends;  // end offset of each entry in the data section
  uint64_t written = 0;        // data bytes accepted so far by the appending calls
  uint64_t written_at = 0;     // data bytes written by write_at
  uint64_t data_start = 0;     // file offset of the data section
  size_t cursor = 0;           // the next entry write_tensor() may name (see sync_cursor)
  std::vector<char> staging;
  uint64_t append_pos = 0;  // file offset of the next appended byte
  int direct_fd = -1;       // the file opened with O_DIRECT (use_direct_io)
  std::unique_ptr<char, decltype(&std::free)> bounce{nullptr, &std::free};
  bool finished = false;

  uint64_t total() const { return ends.empty() ? 0 : ends.back(); }
  uint64_t begin_of(size_t i) const { return i == 0 ? 0 : ends[i - 1]; }

  // Every byte goes to an explicit offset (pwrite): the appending calls at
  // `append_pos`, write_at anywhere.
  void pwrite_all(int to, const char* p, size_t n, uint64_t at) {
    while (n > 0) {
      const ssize_t r = ::pwrite(to, p, n, static_cast<off_t>(at));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0)
        fail(Errc::io, path, ": write of ", n, " bytes at offset ", at, " of ", tmp_path,
             " failed: ", std::strerror(errno));
      p += r;
      at += static_cast<uint64_t>(r);
      n -= size_t(r);
    }
  }
  // With direct I/O, whole aligned blocks bypass the page cache: straight
  // from `p` where it is aligned like the file offset, else through the
  // bounce buffer; the partial blocks at either end go through the page cache
  // (a neighbouring write fills the rest of such a block there).
  void put(const char* p, size_t n, uint64_t at) {
    const uint64_t a = (at + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    const uint64_t b = (at + n) / kDirectAlign * kDirectAlign;
    if (direct_fd < 0 || a >= b) {
      pwrite_all(fd, p, n, at);
      return;
    }
    pwrite_all(fd, p, a - at, at);
    const char* body = p + (a - at);
    if (reinterpret_cast<std::uintptr_t>(body) % kDirectAlign == 0) {
      pwrite_all(direct_fd, body, b - a, a);
    } else {
      // At most the file's size: a writer holding many small files open at
      // once (SavePipeline's disk thread) holds no 4 MiB for each.
      const size_t size = static_cast<size_t>(std::min<uint64_t>(
          kBounceBytes, (data_start + total() + kDirectAlign - 1) / kDirectAlign * kDirectAlign));
      if (!bounce) {
        void* mem = nullptr;
        if (::posix_memalign(&mem, kDirectAlign, size) != 0)
          fail(Errc::io, path, ": no memory for a ", size, "-byte direct I/O buffer");
        bounce.reset(static_cast<char*>(mem));
      }
      for (uint64_t pos = a; pos < b; pos += size) {
        const size_t chunk = static_cast<size_t>(std::min<uint64_t>(size, b - pos));
        std::memcpy(bounce.get(), body + (pos - a), chunk);
        pwrite_all(direct_fd, bounce.get(), chunk, pos);
      }
    }
    pwrite_all(fd, p + (b - at), at + n - b, b);
  }
  // What every data write must be: before finish(), of the file's one mode
  // (appending or positional), from memory, within the declared data.
  void check_write(const char* call, bool positional, const void* data, size_t bytes,
                   uint64_t offset) const {
    if (finished) fail(Errc::invalid_argument, path, ": ", call, " after finish()");
    if (positional ? written > 0 : written_at > 0)
      fail(Errc::invalid_argument, path,
           positional ? ": positional write after appending writes"
                      : ": appending write after positional writes (write_at)");
    if (data == nullptr && bytes > 0)
      fail(Errc::invalid_argument, path, ": ", call, " of ", bytes, " bytes from a null pointer");
    if (offset > total() || bytes > total() - offset)
      fail(Errc::invalid_argument, path, ": writing ", bytes, " bytes at data offset ", offset,
           " runs past the ", total(), " bytes declared for the tensors");
  }
  void flush() {
    put(staging.data(), staging.size(), append_pos - staging.size());
    staging.clear();
  }
  void append(const char* p, size_t n) {
    if (staging.size() + n > kStagingBytes) flush();
    if (n >= kStagingBytes)
      put(p, n, append_pos);
    else
      staging.insert(staging.end(), p, p + n);
    append_pos += n;
  }
  uint64_t size_of(size_t i) const { return ends[i] - begin_of(i); }
  // Moves the cursor past entries that write() has already covered. A
  // zero-sized entry at the write position stays: write_tensor may name it.
  void sync_cursor() {
    while (cursor < ends.size() &&
           (size_of(cursor) > 0 ? ends[cursor] <= written : begin_of(cursor) < written))
      ++cursor;
  }
  // The entry the next data byte belongs to (entries.size() when all are written).
  size_t filling() const {
    size_t i = 0;
    while (i < ends.size() && ends[i] <= written) ++i;
    return i;
  }
  void close_fd() {
    if (fd >= 0) ::close(fd);
    if (direct_fd >= 0) ::close(direct_fd);
    fd = direct_fd = -1;
  }
};

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<Entry> entries,
                                     std::map<std::string, std::string> metadata)
    : impl_(std::make_unique<Impl>()) {
  Impl& w = *impl_;
  w.path = std::move(path);
  w.tmp_path = w.path + ".tmp";
  // Entries stay in declaration order, __metadata__ first, as the reference
  // writer does; readers must not depend on the order anyway.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const Entry& e : entries) {
    if (e.name == "__metadata__")
      fail(Errc::invalid_argument, w.path, ": '__metadata__' is reserved and cannot name a tensor");
    if (!names.insert(e.name).second)
      fail(Errc::invalid_argument, w.path, ": tensor '", e.name, "' declared twice");
    const uint64_t bytes = entry_bytes(e, w.path);
    header[e.name] = {{"dtype", dtype_name(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    w.ends.push_back(offset);
  }
  w.entries = std::move(entries);
  std::string text = header.dump();
  // Spaces pad the header to a multiple of 8 so the data section is 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');

  w.data_start = 8 + text.size();
  w.fd = ::open(w.tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w.fd < 0) fail(Errc::io, w.path, ": cannot create ", w.tmp_path, ": ", std::strerror(errno));
  w.staging.reserve(kStagingBytes);
  try {
    unsigned char prefix[8];
    for (int i = 0; i < 8; ++i) prefix[i] = static_cast<unsigned char>(text.size() >> (8 * i));
    w.append(reinterpret_cast<const char*>(prefix), 8);
    w.append(text.data(), text.size());
  } catch (...) {
    w.close_fd();
    ::unlink(w.tmp_path.c_str());
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (!impl_ || impl_->finished) return;
  impl_->close_fd();
  ::unlink(impl_->tmp_path.c_str());
}

void SafetensorsWriter::write(const void* data, std::size_t bytes) {
  Impl& w = *impl_;
  w.check_write("write", false, data, bytes, w.written);
  w.append(static_cast<const char*>(data), bytes);
  w.written += bytes;
}

void SafetensorsWriter::write_tensor(std::string_view name, const void* data, std::size_t bytes) {
  Impl& w = *impl_;
  if (w.finished)
    fail(Errc::invalid_argument, w.path, ": write_tensor('", name, "') after finish()");
  w.sync_cursor();
  // Zero-sized tensors hold no bytes: naming a later tensor skips them.
  size_t i = w.cursor;
  while (i < w.entries.size() && w.entries[i].name != name && w.size_of(i) == 0) ++i;
  if (i >= w.entries.size())
    fail(Errc::invalid_argument, w.path, ": write_tensor('", name,
         "') but every declared tensor is already written");
  const Entry& e = w.entries[i];
  if (e.name != name)
    fail(Errc::invalid_argument, w.path, ": write_tensor('", name,
         "') but the next declared tensor is '", e.name,
         "' (tensors are written in declaration order)");
  if (w.written != w.begin_of(i))
    fail(Errc::invalid_argument, w.path, ": write_tensor('", name, "') but ",
         w.written - w.begin_of(i), " bytes of it were already written with write()");
  if (bytes != w.size_of(i))
    fail(Errc::mismatch, w.path, ": tensor '", name, "' ", dtype_name(e.dtype), " ",
         shape_str(e.shape), " needs ", w.size_of(i), " bytes, got ", bytes);
  write(data, bytes);
  w.cursor = i + 1;
}

void SafetensorsWriter::write_at(std::uint64_t offset, const void* data, std::size_t bytes) {
  Impl& w = *impl_;
  w.check_write("write_at", true, data, bytes, offset);
  if (!w.staging.empty()) w.flush();  // the header
  w.put(static_cast<const char*>(data), bytes, w.data_start + offset);
  w.written_at += bytes;
}

bool SafetensorsWriter::use_direct_io() {
  Impl& w = *impl_;
  if (w.direct_fd >= 0) return true;
  if (w.finished || w.written > 0 || w.written_at > 0)
    fail(Errc::invalid_argument, w.path, ": use_direct_io() after data was written");
  // Where the filesystem refuses O_DIRECT (tmpfs, some FUSE), the page cache it is.
  w.direct_fd = ::open(w.tmp_path.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
  return w.direct_fd >= 0;
}

void SafetensorsWriter::finish() {
  Impl& w = *impl_;
  if (w.finished) fail(Errc::invalid_argument, w.path, ": finish() called twice");
  if (w.written_at > 0 && w.written_at != w.total())
    fail(Errc::mismatch, w.path, ": finish() after positional writes of ", w.written_at, " of ",
         w.total(), " data bytes");
  if (w.written_at == 0 && w.written != w.total()) {
    const size_t i = w.filling();
    fail(Errc::mismatch, w.path, ": finish() after ", w.written, " of ", w.total(),
         " data bytes; tensor '", w.entries[i].name, "' has ", w.written - w.begin_of(i),
         " of its ", w.size_of(i), " bytes");
  }
  w.flush();
  // No fsync: the file is complete for every reader on this machine once
  // renamed, and syncing multi-GB dumps would dominate the step time.
  if (w.direct_fd >= 0) ::close(w.direct_fd);
  w.direct_fd = -1;
  w.bounce.reset();
  const int fd = w.fd;
  w.fd = -1;
  if (::close(fd) != 0)
    fail(Errc::io, w.path, ": closing ", w.tmp_path, " failed: ", std::strerror(errno));
  if (::rename(w.tmp_path.c_str(), w.path.c_str()) != 0)
    fail(Errc::io, w.path, ": cannot rename ", w.tmp_path, " into place: ", std::strerror(errno));
  w.finished = true;
}

}  // namespace weightsync
