// Seeded random checkpoints. Each 64-bit word of a tensor's element stream
// comes from splitmix64 of (tensor seed, word index), so any element can be
// recomputed on its own and filling runs at a few GB/s.
#include "random_checkpoint.h"

#include <weightsync/error.h>
#include <weightsync/safetensors.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

namespace weightsync {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t tensor_seed(std::string_view key, uint64_t seed) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char ch : key) h = (h ^ ch) * 0x100000001b3ull;
  return splitmix64(h ^ splitmix64(seed));
}

// How a float format is built from random bits: a random sign, a field of
// (exp_bits + mant_bits) bits that the version shifts, exponents starting at
// exp_base (a normal number, magnitude around 2^-8 .. 2).
struct FloatFormat {
  int total_bits;
  int mant_bits;
  int exp_bits;  // how many exponent bits vary
  uint64_t exp_base;
  bool has_sign;
};

bool float_format(DType d, FloatFormat& f) {
  switch (d) {
    case DType::F64:
      f = {64, 52, 3, 1023 - 8, true};
      return true;
    case DType::F32:
      f = {32, 23, 3, 127 - 8, true};
      return true;
    case DType::BF16:
      f = {16, 7, 3, 127 - 8, true};
      return true;
    case DType::F16:
      f = {16, 10, 3, 15 - 8, true};
      return true;
    case DType::F8_E4M3:
      f = {8, 3, 3, 1, true};  // biased exponents 1..8: never the NaN pattern
      return true;
    case DType::F8_E5M2:
      f = {8, 2, 4, 1, true};  // 4 exponent bits keep the field at 6 bits
      return true;
    case DType::F8_E8M0:
      f = {8, 0, 6, 127 - 32, false};
      return true;
    default:
      return false;
  }
}

uint64_t element_bits(uint64_t r, uint64_t version, DType dtype, const FloatFormat* f) {
  if (dtype == DType::BOOL) return (r + version) & 1;
  if (!f) return r + version;  // integers: every bit pattern is a value
  const int field_bits = f->mant_bits + f->exp_bits;
  const uint64_t field = (r + version) & ((uint64_t{1} << field_bits) - 1);
  uint64_t bits = ((f->exp_base + (field >> f->mant_bits)) << f->mant_bits) |
                  (field & ((uint64_t{1} << f->mant_bits) - 1));
  if (f->has_sign) bits |= ((r >> (f->total_bits - 1)) & 1) << (f->total_bits - 1);
  return bits;
}

template <class T>
void fill_typed(uint64_t tseed, uint64_t version, DType dtype, const FloatFormat* f, int64_t first,
                int64_t count, T* out) {
  constexpr int64_t per_word = 8 / sizeof(T);
  constexpr int shift = sizeof(T) * 8 == 64 ? 0 : sizeof(T) * 8;
  int64_t i = first;
  const int64_t end = first + count;
  while (i < end) {
    const int64_t word = i / per_word;
    uint64_t r = splitmix64(tseed + static_cast<uint64_t>(word) * 0xd1b54a32d192ed03ull);
    const int64_t lane = i % per_word;
    if (shift) r >>= shift * lane;
    for (int64_t l = lane; l < per_word && i < end; ++l, ++i) {
      const uint64_t chunk = shift ? (r & ((uint64_t{1} << shift) - 1)) : r;
      *out++ = static_cast<T>(element_bits(chunk, version, dtype, f));
      if (shift) r >>= shift;
    }
  }
}

}  // namespace

void fill_random(std::string_view key, DType dtype, uint64_t seed, uint64_t version, int64_t first,
                 int64_t count, void* out) {
  if (first < 0 || count < 0)
    fail(Errc::invalid_argument, "fill_random: negative range for '", key, "'");
  FloatFormat ff;
  const FloatFormat* f = float_format(dtype, ff) ? &ff : nullptr;
  const uint64_t ts = tensor_seed(key, seed);
  switch (itemsize(dtype)) {
    case 1:
      return fill_typed(ts, version, dtype, f, first, count, static_cast<uint8_t*>(out));
    case 2:
      return fill_typed(ts, version, dtype, f, first, count, static_cast<uint16_t*>(out));
    case 4:
      return fill_typed(ts, version, dtype, f, first, count, static_cast<uint32_t*>(out));
    case 8:
      return fill_typed(ts, version, dtype, f, first, count, static_cast<uint64_t*>(out));
  }
  fail(Errc::unsupported, "fill_random: dtype ", dtype_name(dtype), " of '", key, "'");
}

namespace {

constexpr size_t kChunkBytes = 8u << 20;

void write_file(const std::string& path, const std::vector<const HfTensorSpec*>& tensors,
                const RandomCheckpointOptions& o, std::vector<char>& buffer) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto* t : tensors) entries.push_back({t->key, t->dtype, t->shape});
  SafetensorsWriter writer(path, std::move(entries),
                           {{"format", "pt"},
                            {"weightsync_seed", std::to_string(o.seed)},
                            {"weightsync_version", std::to_string(o.version)}});
  for (const auto* t : tensors) {
    const int64_t item = static_cast<int64_t>(itemsize(t->dtype));
    const int64_t per_chunk = static_cast<int64_t>(buffer.size()) / item;
    const int64_t n = numel(t->shape);
    for (int64_t first = 0; first < n; first += per_chunk) {
      const int64_t count = std::min(per_chunk, n - first);
      fill_random(t->key, t->dtype, o.seed, o.version, first, count, buffer.data());
      writer.write(buffer.data(), static_cast<size_t>(count * item));
    }
  }
  writer.finish();
}

std::string shard_name(int i, int n) {
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", i + 1, n);
  return name;
}

}  // namespace

void write_random_checkpoint(const std::string& path, const std::vector<HfTensorSpec>& tensors,
                             const RandomCheckpointOptions& o) {
  if (o.num_files < 0)
    fail(Errc::invalid_argument, "write_random_checkpoint: num_files ", o.num_files, " < 0");
  std::set<std::string_view> seen;
  uint64_t total = 0;
  for (const auto& t : tensors) {
    if (!seen.insert(t.key).second)
      fail(Errc::invalid_argument, "write_random_checkpoint: duplicate key '", t.key, "'");
    total += static_cast<uint64_t>(numel(t.shape)) * itemsize(t.dtype);
  }
  std::vector<char> buffer(kChunkBytes);
  if (o.num_files == 0) {
    std::vector<const HfTensorSpec*> all;
    for (const auto& t : tensors) all.push_back(&t);
    write_file(path, all, o, buffer);
    return;
  }
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) fail(Errc::io, "write_random_checkpoint: cannot create '", path, "': ", ec.message());
  // Tensors go to files in order, each file taking about total/N bytes.
  const int n = o.num_files;
  std::vector<std::vector<const HfTensorSpec*>> files(static_cast<size_t>(n));
  nlohmann::json weight_map = nlohmann::json::object();
  uint64_t before = 0;
  for (const auto& t : tensors) {
    const int f = total == 0 ? 0 : static_cast<int>(std::min<uint64_t>(n - 1, before * n / total));
    files[static_cast<size_t>(f)].push_back(&t);
    weight_map[t.key] = shard_name(f, n);
    before += static_cast<uint64_t>(numel(t.shape)) * itemsize(t.dtype);
  }
  for (int f = 0; f < n; ++f)
    write_file(path + "/" + shard_name(f, n), files[static_cast<size_t>(f)], o, buffer);
  const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  const std::string index_path = path + "/model.safetensors.index.json";
  std::ofstream out(index_path + ".tmp");
  out << index.dump(2) << "\n";
  out.close();
  if (!out) fail(Errc::io, "write_random_checkpoint: cannot write '", index_path, "'");
  std::filesystem::rename(index_path + ".tmp", index_path, ec);
  if (ec)
    fail(Errc::io, "write_random_checkpoint: cannot rename '", index_path, "': ", ec.message());
}

}  // namespace weightsync
