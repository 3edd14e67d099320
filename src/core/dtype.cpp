#include <weightsync/dtype.h>
#include <weightsync/error.h>

#include <array>

namespace weightsync {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  std::size_t size;
};

constexpr std::array<DTypeInfo, 16> kDTypes{{
    {DType::BOOL, "BOOL", 1},
    {DType::U8, "U8", 1},
    {DType::I8, "I8", 1},
    {DType::I16, "I16", 2},
    {DType::U16, "U16", 2},
    {DType::I32, "I32", 4},
    {DType::U32, "U32", 4},
    {DType::I64, "I64", 8},
    {DType::U64, "U64", 8},
    {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2},
    {DType::F32, "F32", 4},
    {DType::F64, "F64", 8},
    {DType::F8_E4M3, "F8_E4M3", 1},
    {DType::F8_E5M2, "F8_E5M2", 1},
    {DType::F8_E8M0, "F8_E8M0", 1},
}};

}  // namespace

std::size_t itemsize(DType dtype) noexcept {
  return kDTypes[static_cast<size_t>(dtype)].size;
}

std::string_view dtype_name(DType dtype) noexcept {
  return kDTypes[static_cast<size_t>(dtype)].name;
}

std::optional<DType> parse_dtype(std::string_view name) noexcept {
  for (const auto& info : kDTypes)
    if (info.name == name) return info.dtype;
  return std::nullopt;
}

DType dtype_from_name(std::string_view name, std::string_view context) {
  if (auto d = parse_dtype(name)) return *d;
  fail(Errc::format, context, ": unknown dtype '", name,
       "' (expected a safetensors name: BOOL, U8, I8, I16, U16, I32, U32, I64, U64, F16, BF16, "
       "F32, F64, F8_E4M3, F8_E5M2, F8_E8M0)");
}

}  // namespace weightsync
