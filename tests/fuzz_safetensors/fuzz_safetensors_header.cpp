// libFuzzer target: a whole safetensors file image (8-byte length, header,
// data) through the framing and the header parser. Malformed input must end
// in weightsync::Error; anything else escaping, or a sanitizer report, is a bug.
#include <weightsync/error.h>
#include <weightsync/safetensors.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    const auto layout = weightsync::parse_safetensors_image(bytes, "fuzz.safetensors");
    // Whatever parsed must describe bytes inside the image: touch them all.
    volatile uint8_t sink = 0;
    for (const auto& t : layout.header.tensors)
      for (uint64_t i = t.begin; i < t.end; ++i) sink = sink ^ data[layout.data_offset + i];
  } catch (const weightsync::Error&) {
  }
  // The same bytes as a bare header over a data section of their own length:
  // reaches the entry checks without the fuzzer having to forge a prefix.
  try {
    weightsync::parse_safetensors_header(bytes, size, "fuzz.json");
  } catch (const weightsync::Error&) {
  }
  return 0;
}
