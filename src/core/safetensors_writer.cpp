// SafetensorsWriter: the header is fixed by the declared entries, so the file
// is written front to back in one pass with bounded memory (one staging
// buffer), whatever the size of the tensors.
#include <weightsync/error.h>
#include <weightsync/safetensors.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <set>

#include <fcntl.h>
#include <unistd.h>

namespace weightsync {
namespace {

// Small writes are gathered into this much memory before reaching the OS;
// larger ones go straight through.
constexpr size_t kStagingBytes = size_t(4) << 20;

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
  uint64_t written = 0;        // data bytes accepted so far
  size_t cursor = 0;           // the next entry write_tensor() may name (see sync_cursor)
  std::vector<char> staging;
  bool finished = false;

  uint64_t total() const { return ends.empty() ? 0 : ends.back(); }
  uint64_t begin_of(size_t i) const { return i == 0 ? 0 : ends[i - 1]; }

  void write_all(const char* p, size_t n) {
    while (n > 0) {
      ssize_t r = ::write(fd, p, n);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) fail(Errc::io, path, ": write to ", tmp_path, " failed: ", std::strerror(errno));
      p += r;
      n -= size_t(r);
    }
  }
  void flush() {
    write_all(staging.data(), staging.size());
    staging.clear();
  }
  void append(const char* p, size_t n) {
    if (staging.size() + n > kStagingBytes) flush();
    if (n >= kStagingBytes)
      write_all(p, n);
    else
      staging.insert(staging.end(), p, p + n);
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
    fd = -1;
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
  if (w.finished) fail(Errc::invalid_argument, w.path, ": write after finish()");
  if (data == nullptr && bytes > 0)
    fail(Errc::invalid_argument, w.path, ": write of ", bytes, " bytes from a null pointer");
  if (bytes > w.total() - w.written)
    fail(Errc::invalid_argument, w.path, ": writing ", bytes, " bytes at data offset ", w.written,
         " runs past the ", w.total(), " bytes declared for the tensors");
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

void SafetensorsWriter::finish() {
  Impl& w = *impl_;
  if (w.finished) fail(Errc::invalid_argument, w.path, ": finish() called twice");
  if (w.written != w.total()) {
    const size_t i = w.filling();
    fail(Errc::mismatch, w.path, ": finish() after ", w.written, " of ", w.total(),
         " data bytes; tensor '", w.entries[i].name, "' has ", w.written - w.begin_of(i),
         " of its ", w.size_of(i), " bytes");
  }
  w.flush();
  // No fsync: the file is complete for every reader on this machine once
  // renamed, and syncing multi-GB dumps would dominate the step time.
  const int fd = w.fd;
  w.fd = -1;
  if (::close(fd) != 0)
    fail(Errc::io, w.path, ": closing ", w.tmp_path, " failed: ", std::strerror(errno));
  if (::rename(w.tmp_path.c_str(), w.path.c_str()) != 0)
    fail(Errc::io, w.path, ": cannot rename ", w.tmp_path, " into place: ", std::strerror(errno));
  w.finished = true;
}

}  // namespace weightsync
