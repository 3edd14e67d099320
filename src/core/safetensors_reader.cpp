// SafetensorsFile: one .safetensors file mapped read-only. open() touches only
// the pages of the header; tensor bytes are paged in when a view is read.
#include <weightsync/error.h>
#include <weightsync/safetensors.h>

#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace weightsync {
namespace {

// Closes the descriptor on every path out of open(); the mapping outlives it.
struct FileDescriptor {
  int fd = -1;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

[[noreturn]] void fail_errno(int err, const std::string& what, const std::string& path) {
  fail(err == ENOENT ? Errc::not_found : Errc::io, path, ": cannot ", what, ": ",
       std::strerror(err));
}

}  // namespace

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  FileDescriptor file;
  file.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file.fd < 0) fail_errno(errno, "open safetensors file", path);
  struct stat st {};
  if (::fstat(file.fd, &st) != 0) fail_errno(errno, "stat", path);
  if (!S_ISREG(st.st_mode))
    fail(Errc::io, path, ": not a regular file (expected a .safetensors file)");
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < 8)
    fail(Errc::format, path, ": ", size,
         " bytes is too short for a safetensors file (8-byte header length expected)");

  std::shared_ptr<SafetensorsFile> self(new SafetensorsFile());
  self->path_ = path;
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, file.fd, 0);
  if (map == MAP_FAILED) fail_errno(errno, "mmap", path);
  // From here the destructor unmaps, also when the header turns out malformed.
  self->map_ = static_cast<const char*>(map);
  self->map_size_ = size;

  SafetensorsLayout layout = parse_safetensors_image(std::string_view(self->map_, size), path);
  self->data_ = self->map_ + layout.data_offset;
  self->header_ = std::move(layout.header);
  for (size_t i = 0; i < self->header_.tensors.size(); ++i)
    self->index_.emplace(self->header_.tensors[i].name, i);
  return self;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(const_cast<char*>(map_), map_size_);
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

TensorView SafetensorsFile::view(std::string_view name) const {
  const TensorInfo* info = find(name);
  if (!info) fail(Errc::not_found, path_, ": no tensor '", name, "'");
  // The pages are PROT_READ: TensorView has no const flavour, so the constness
  // is cast away here and callers must only read through it.
  return host_view(const_cast<char*>(data_ + info->begin), info->dtype, info->shape);
}

}  // namespace weightsync
