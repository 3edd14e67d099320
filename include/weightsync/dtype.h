// Element types, named as safetensors names them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace weightsync {

enum class DType : uint8_t {
  BOOL,
  U8,
  I8,
  I16,
  U16,
  I32,
  U32,
  I64,
  U64,
  F16,
  BF16,
  F32,
  F64,
  F8_E4M3,
  F8_E5M2,
  F8_E8M0,
};

// Size of one element in bytes.
std::size_t itemsize(DType dtype) noexcept;
// The safetensors name: "BF16", "F8_E4M3", ...
std::string_view dtype_name(DType dtype) noexcept;
// nullopt for a name safetensors does not define.
std::optional<DType> parse_dtype(std::string_view name) noexcept;
// Like parse_dtype, but throws Errc::format naming `context` (a key or file).
DType dtype_from_name(std::string_view name, std::string_view context);

}  // namespace weightsync
