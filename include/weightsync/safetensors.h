// safetensors files: a bounds-checked, mmap-based reader (one file, or an HF
// directory with model.safetensors.index.json) and a streaming writer.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"key": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
// then the data section; offsets are relative to the data section.
#pragma once

#include <weightsync/tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace weightsync {

struct TensorInfo {
  std::string name;
  DType dtype = DType::U8;
  Shape shape;
  uint64_t begin = 0;  // byte offsets inside the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // sorted by begin offset
  std::map<std::string, std::string> metadata;
};

// Parses and validates header JSON for a data section of `data_size` bytes.
// Every malformed input is Errc::format naming `file` and the key: not JSON,
// not an object, unknown dtype, bad shape, offsets out of range, overlapping
// or with gaps, shape x itemsize != byte length, duplicate key.
SafetensorsHeader parse_safetensors_header(std::string_view json, uint64_t data_size,
                                           std::string_view file);

// Largest header accepted, as in the reference implementation (100 MB): a
// corrupt length prefix must not make a reader allocate or scan gigabytes.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

struct SafetensorsLayout {
  SafetensorsHeader header;
  uint64_t data_offset = 0;  // 8 + header length: where the data section starts
};

// Parses a whole file image: the 8-byte length prefix, the header, and checks
// the header against the data section that follows. Errc::format naming
// `file` when it is shorter than 8 bytes, the header length is absurd or runs
// past the end, or the header is malformed (see parse_safetensors_header).
SafetensorsLayout parse_safetensors_image(std::string_view bytes, std::string_view file);

// One mmapped .safetensors file. Views point into the mapping (read-only pages:
// never write through them) and live as long as the file object.
class SafetensorsFile {
 public:
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  const TensorInfo* find(std::string_view name) const;
  // Throws Errc::not_found naming the key and the file.
  TensorView view(std::string_view name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  SafetensorsHeader header_;
  std::map<std::string, size_t, std::less<>> index_;
  const char* map_ = nullptr;
  uint64_t map_size_ = 0;
  const char* data_ = nullptr;
};

// A checkpoint: a single .safetensors file, or a directory holding either
// model.safetensors.index.json (its weight_map names the files) or exactly one
// .safetensors file.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> keys() const;  // sorted
  bool contains(std::string_view key) const;
  // Throw Errc::not_found naming the key and the checkpoint.
  const TensorInfo& info(std::string_view key) const;
  TensorView view(std::string_view key) const;
  // The files behind the checkpoint, in path order.
  const std::vector<std::shared_ptr<SafetensorsFile>>& files() const { return files_; }
  // A single file's __metadata__, or the index's "metadata" (values that are
  // not strings, like total_size, as their JSON text).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::string path_;
  std::map<std::string, std::string> metadata_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::pair<size_t, const TensorInfo*>, std::less<>> keys_;
};

// Streams a .safetensors file to disk: the tensors are declared up front, then
// their bytes are written in declaration order, in as many chunks as wanted.
// Data goes to `path`.tmp and is renamed to `path` by finish(); a writer
// destroyed before finish() removes the temporary file, leaving `path` as it was.
class SafetensorsWriter {
 public:
  struct Entry {
    std::string name;
    DType dtype = DType::U8;
    Shape shape;
  };

  SafetensorsWriter(std::string path, std::vector<Entry> entries,
                    std::map<std::string, std::string> metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends bytes to the data section (Errc::invalid_argument past the end).
  void write(const void* data, std::size_t bytes);
  // Writes the whole of the next declared tensor; `name` must be that tensor.
  void write_tensor(std::string_view name, const void* data, std::size_t bytes);
  // Writes `bytes` at `offset` of the data section, in any order (positional
  // writes, for a writer whose tensors become ready out of order). A file is
  // written either this way or with the appending calls above, not both;
  // finish() then checks that the positional writes add up to the data
  // section (each byte must be written once: overlaps are not detected).
  void write_at(std::uint64_t offset, const void* data, std::size_t bytes);
  // From now on (before any data byte), whole aligned blocks of data bypass
  // the page cache (O_DIRECT: no copy into it, no writeback later; memory
  // not aligned like the file goes through a small bounce buffer). False,
  // and nothing changes, where the filesystem refuses O_DIRECT.
  bool use_direct_io();
  // Checks that every declared byte was written, flushes, renames into place.
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightsync
