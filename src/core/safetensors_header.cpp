// The safetensors header parser and the 8-byte length framing. Kept apart
// from the mmap reader so the fuzz target compiles only this file, dtype.cpp
// and error.cpp. Every check follows the safetensors spec: the header starts
// with '{', may be padded with trailing spaces, names no key twice, and the
// tensors cover the data section exactly, from 0 to its last byte.
#include "safetensors_json.h"

#include <nlohmann/json.hpp>

#include <weightsync/error.h>
#include <weightsync/safetensors.h>

#include <algorithm>
#include <limits>
#include <utility>

namespace weightsync {
namespace detail {

namespace {

// Builds the DOM from SAX events. Checking each key against the object being
// filled is both the duplicate test and O(log n); nlohmann's parser-callback
// route would do it too but rescans the parent object at every end_object,
// which is quadratic in the number of tensors.
class StrictDomBuilder {
 public:
  using json = nlohmann::json;
  json root;
  std::string duplicate, error;

  bool null() { return place(nullptr); }
  bool boolean(bool v) { return place(v); }
  bool number_integer(json::number_integer_t v) { return place(v); }
  bool number_unsigned(json::number_unsigned_t v) { return place(v); }
  bool number_float(json::number_float_t v, const json::string_t&) { return place(v); }
  bool string(json::string_t& v) { return place(std::move(v)); }
  bool binary(json::binary_t& v) { return place(json::binary(std::move(v))); }
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    json& object = *open_.back();
    if (object.contains(k)) {
      duplicate = k;
      return false;
    }
    slot_ = &object[k];
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    error = e.what();
    return false;
  }

 private:
  // Puts a value where the grammar says it goes; returns where it landed.
  json* put(json&& value) {
    if (open_.empty()) {
      root = std::move(value);
      return &root;
    }
    json& parent = *open_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(value));
      return &parent.back();  // stable: nothing is appended to parent while this is open
    }
    *slot_ = std::move(value);
    return slot_;
  }
  bool place(json&& value) {
    put(std::move(value));
    return true;
  }
  bool open(json&& container) {
    open_.push_back(put(std::move(container)));
    return true;
  }
  bool close() {
    open_.pop_back();
    return true;
  }
  std::vector<json*> open_;
  json* slot_ = nullptr;
};

}  // namespace

nlohmann::json parse_json_no_duplicates(std::string_view text, std::string_view file) {
  StrictDomBuilder builder;
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(text.begin(), text.end(), &builder);
  } catch (const nlohmann::json::exception& e) {
    fail(Errc::format, file, ": not valid JSON (", e.what(), ")");
  }
  if (!builder.duplicate.empty())
    fail(Errc::format, file, ": duplicate key '", builder.duplicate,
         "' (each key may appear once in an object)");
  if (!ok) fail(Errc::format, file, ": not valid JSON (", builder.error, ")");
  return std::move(builder.root);
}

}  // namespace detail

namespace {

using nlohmann::json;

std::string entry_context(std::string_view file, const std::string& key) {
  return cat(file, ": tensor '", key, "'");
}

DType entry_dtype(const json& entry, const std::string& ctx) {
  auto it = entry.find("dtype");
  if (it == entry.end()) fail(Errc::format, ctx, ": missing \"dtype\"");
  if (!it->is_string())
    fail(Errc::format, ctx, ": \"dtype\" must be a string, got ", it->type_name());
  return dtype_from_name(it->get_ref<const std::string&>(), ctx);
}

// A shape whose element count (ignoring zero dims) fits in int64, so that
// numel(), strides and byte counts computed from it never overflow.
Shape entry_shape(const json& entry, const std::string& ctx) {
  auto it = entry.find("shape");
  if (it == entry.end()) fail(Errc::format, ctx, ": missing \"shape\"");
  if (!it->is_array())
    fail(Errc::format, ctx, ": \"shape\" must be an array of integers, got ", it->type_name());
  Shape shape;
  shape.reserve(it->size());
  uint64_t product = 1;
  for (size_t d = 0; d < it->size(); ++d) {
    const json& dim = (*it)[d];
    if (!dim.is_number_integer())
      fail(Errc::format, ctx, ": shape dim ", d, " must be an integer, got ", dim.dump());
    if (dim.is_number_unsigned() ? dim.get<uint64_t>() > uint64_t(INT64_MAX)
                                 : dim.get<int64_t>() < 0)
      fail(Errc::format, ctx, ": shape dim ", d, " must be in [0, 2^63), got ", dim.dump());
    const int64_t n = dim.get<int64_t>();
    if (n != 0 &&
        (__builtin_mul_overflow(product, uint64_t(n), &product) || product > uint64_t(INT64_MAX)))
      fail(Errc::format, ctx, ": shape ", dim.dump(), " at dim ", d,
           " makes the element count overflow 64 bits");
    shape.push_back(n);
  }
  return shape;
}

std::pair<uint64_t, uint64_t> entry_offsets(const json& entry, const std::string& ctx) {
  auto it = entry.find("data_offsets");
  if (it == entry.end()) fail(Errc::format, ctx, ": missing \"data_offsets\"");
  if (!it->is_array() || it->size() != 2 || !(*it)[0].is_number_unsigned() ||
      !(*it)[1].is_number_unsigned())
    fail(Errc::format, ctx,
         ": \"data_offsets\" must be [begin, end] of non-negative integers, got ", it->dump());
  const uint64_t begin = (*it)[0].get<uint64_t>(), end = (*it)[1].get<uint64_t>();
  if (begin > end) fail(Errc::format, ctx, ": data_offsets begin ", begin, " is past end ", end);
  return {begin, end};
}

TensorInfo parse_entry(const std::string& key, const json& entry, uint64_t data_size,
                       std::string_view file) {
  const std::string ctx = entry_context(file, key);
  if (!entry.is_object())
    fail(Errc::format, ctx, ": entry must be an object {dtype, shape, data_offsets}, got ",
         entry.type_name());
  TensorInfo info;
  info.name = key;
  info.dtype = entry_dtype(entry, ctx);
  info.shape = entry_shape(entry, ctx);
  std::tie(info.begin, info.end) = entry_offsets(entry, ctx);
  if (info.end > data_size)
    fail(Errc::format, ctx, ": data_offsets [", info.begin, ", ", info.end,
         "] run past the data section of ", data_size, " bytes");
  uint64_t elements = 1;
  for (int64_t d : info.shape) elements *= uint64_t(d);  // bounded by entry_shape
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(elements, itemsize(info.dtype), &bytes) ||
      bytes != info.end - info.begin)
    fail(Errc::format, ctx, ": shape ", shape_str(info.shape), " of ", dtype_name(info.dtype),
         " needs ", elements, " x ", itemsize(info.dtype), " bytes but data_offsets [", info.begin,
         ", ", info.end, "] hold ", info.end - info.begin);
  return info;
}

void parse_metadata(const json& meta, std::string_view file,
                    std::map<std::string, std::string>& out) {
  if (!meta.is_object())
    fail(Errc::format, file, ": \"__metadata__\" must be an object of strings, got ",
         meta.type_name());
  for (const auto& [k, v] : meta.items()) {
    if (!v.is_string())
      fail(Errc::format, file, ": \"__metadata__\" value of '", k, "' must be a string, got ",
           v.type_name());
    out.emplace(k, v.get<std::string>());
  }
}

// The data section must be covered exactly: sorted by offsets, each tensor
// starts where the previous one ended, the first at 0, the last at the end.
void check_coverage(const std::vector<TensorInfo>& tensors, uint64_t data_size,
                    std::string_view file) {
  uint64_t covered = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& t : tensors) {
    if (t.begin < covered)
      fail(Errc::format, entry_context(file, t.name), ": data_offsets [", t.begin, ", ", t.end,
           "] overlap tensor '", previous->name, "' which ends at ", covered);
    if (t.begin > covered)
      fail(Errc::format, entry_context(file, t.name), ": data_offsets [", t.begin, ", ", t.end,
           "] leave a gap of ", t.begin - covered, " bytes after ",
           previous ? cat("tensor '", previous->name, "'") : std::string("the data start"),
           " (tensors must cover the data section contiguously)");
    covered = t.end;
    previous = &t;
  }
  if (covered != data_size)
    fail(Errc::format, file, ": the tensors cover ", covered, " bytes but the data section holds ",
         data_size, " (", data_size - covered, " trailing bytes belong to no tensor)");
}

uint64_t read_le64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

SafetensorsHeader parse_safetensors_header(std::string_view text, uint64_t data_size,
                                           std::string_view file) {
  // The spec requires '{' first: it rules out leading whitespace and BOMs
  // that other readers would refuse.
  if (text.empty() || text.front() != '{')
    fail(Errc::format, file, ": the header must be a JSON object starting with '{'");
  const json root = detail::parse_json_no_duplicates(text, file);
  if (!root.is_object())
    fail(Errc::format, file, ": the header must be a JSON object, got ", root.type_name());
  SafetensorsHeader header;
  header.tensors.reserve(root.size());
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__")
      parse_metadata(value, file, header.metadata);
    else
      header.tensors.push_back(parse_entry(key, value, data_size, file));
  }
  // Zero-sized tensors share offsets with their neighbours; the name breaks
  // ties so the order (and every error message) is deterministic.
  std::sort(header.tensors.begin(), header.tensors.end(), [](const auto& a, const auto& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  check_coverage(header.tensors, data_size, file);
  return header;
}

SafetensorsLayout parse_safetensors_image(std::string_view bytes, std::string_view file) {
  if (bytes.size() < 8)
    fail(Errc::format, file, ": ", bytes.size(),
         " bytes is too short for a safetensors file (8-byte header length expected)");
  const uint64_t n = read_le64(reinterpret_cast<const unsigned char*>(bytes.data()));
  if (n > kMaxSafetensorsHeaderBytes)
    fail(Errc::format, file, ": header length ", n, " exceeds the limit of ",
         kMaxSafetensorsHeaderBytes, " bytes (corrupt or not a safetensors file)");
  if (n > bytes.size() - 8)
    fail(Errc::format, file, ": header length ", n, " runs past the end of the file (",
         bytes.size(), " bytes)");
  SafetensorsLayout layout;
  layout.data_offset = 8 + n;
  layout.header =
      parse_safetensors_header(bytes.substr(8, n), bytes.size() - layout.data_offset, file);
  return layout;
}

}  // namespace weightsync
