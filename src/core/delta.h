// Delta encoding of a plan item's bytes (issue "delta sync"): the elements
// that changed since the version the receiver holds, so that a step moves
// only those. Element-wise on the engine dtype's bytes (BF16, FP8 codes, F32
// scales...): an element is "changed" when any of its bytes differs.
//
// The item is cut into chunks of kChunkElements elements (the last one
// shorter), each encoded by itself as one record, back to back, no padding:
//
//   u16 head            kind in the top 2 bits, count in the low 14
//   kind 0 unchanged    count 0; nothing follows
//   kind 1 list         count k changed elements: k u16 indices (ascending,
//                       inside the chunk), then the k new elements
//   kind 2 runs         count r runs: r pairs (u16 start, u16 length >= 1),
//                       ascending and apart, then their new elements in order
//   kind 3 dense        count 0; the chunk's new elements, all of them
//
// Integers are little-endian. The encoder takes, per chunk, the smallest of
// list, runs and dense (dense on a tie), so an encoding is never larger than
// the dense bytes by more than 2 bytes a chunk (0.024 % for BF16); the
// receiver knows the element count and size, so no other header is needed.
//
// The encoder keeps the sender's copy of the receiver's bytes (`base`) in
// step: it writes the changed elements into it as it encodes. apply checks
// a whole encoding before writing anything, so malformed bytes (a truncated
// record, an index outside its chunk, bytes left over) change nothing.
#pragma once

#include "core/delta_tables.h"

#include <cstdint>
#include <string>
#include <vector>

namespace weightsync::delta {

inline constexpr int64_t kChunkElements = 4096;

enum class ChunkKind : uint8_t { unchanged = 0, list = 1, runs = 2, dense = 3 };

// The largest encoding of `elements` elements of `element_bytes` bytes: the
// dense bytes and a record head per chunk.
int64_t max_encoded_bytes(int64_t elements, int element_bytes) noexcept;
// The encoding of `elements` elements none of which changed: a record head
// per chunk. A sound encoding of another size changes at least one element.
int64_t unchanged_bytes(int64_t elements) noexcept;

struct EncodeStats {
  int64_t elements = 0;
  int64_t changed = 0;               // elements that differ from the base
  int64_t chunks[4] = {0, 0, 0, 0};  // by ChunkKind
  int64_t bytes = 0;                 // encoded
};

// The digest of an item's bytes as a delta step checks them: the sum of its
// chunks' checksum64 (weightsync/checksum.h), chunk c hashed with seed
// chunk_seed(seed, c). Each chunk hashes by itself, so the encoder and the
// applier hash a chunk while it is in cache, and a GPU hashes every chunk
// at once (cuda/delta_kernel.cu); a sum does not depend on the order.
struct Digest {
  uint64_t seed = 0;
  uint64_t sum = 0;
};
uint64_t chunk_seed(uint64_t seed, int64_t chunk) noexcept;
// The digest of `elements` elements of `element_bytes` bytes at `data`.
uint64_t digest(const void* data, int64_t elements, int element_bytes, uint64_t seed) noexcept;

// Encodes `next` against `base` (each `elements` elements of `element_bytes`
// bytes: 1, 2, 4 or 8) into `out`, which holds max_encoded_bytes, and writes
// the changed elements into `base`, which then equals `next`. Returns the
// encoded bytes. Errc::invalid_argument for another element size. With
// `hash`, the digest of `next` is added to hash->sum, chunk by chunk while
// in cache.
int64_t encode(const void* next, void* base, int64_t elements, int element_bytes, void* out,
               EncodeStats* stats = nullptr, Digest* hash = nullptr);
// encode without the popcount instruction, as on an x86-64 CPU that lacks
// it (encode picks the instruction at run time where the CPU has it): the
// same bytes, which the tests check.
int64_t encode_baseline(const void* next, void* base, int64_t elements, int element_bytes,
                        void* out, EncodeStats* stats = nullptr, Digest* hash = nullptr);

// About what encode() would return for `next` against `base`, from samples
// (256 bytes somewhere in every 16 KiB, about 1/64 of the bytes), without
// writing anything: what a sender
// reads before it pays for an encoding that would come out nearly whole.
// Exact for uniformly scattered changes only in expectation; changes that
// fall between the samples go unseen.
int64_t estimate_encoded_bytes(const void* next, const void* base, int64_t elements,
                               int element_bytes);

// Applies `bytes` bytes of an encoding to `target` (the `elements` elements
// the encoding's base holds). Errc::format naming `what`, the chunk and what
// is wrong when the encoding is malformed; `target` is then unchanged.
// With `hash`, the digest of the target's bytes after the patch is added to
// hash->sum, chunk by chunk while in cache.
void apply(const void* encoding, int64_t bytes, void* target, int64_t elements, int element_bytes,
           const std::string& what, Digest* hash = nullptr);
// What apply checks, without a target: Errc::format as apply throws it.
void check(const void* encoding, int64_t bytes, int64_t elements, int element_bytes,
           const std::string& what);

// Tables for applying encodings where the CPU does not reach the target (a
// GPU's params: cuda/delta_kernel.cu runs them; PatchChunk and HashChunk
// are in delta_tables.h). The CPU checks each encoding and decodes its
// records' places; the kernel only executes them.
//
// Checks `bytes` bytes of an encoding of `elements` elements as apply does
// (Errc::format naming `what`, and `out` unchanged) and appends a
// PatchChunk per chunk that changes an element, with the encoding at
// `encoding_offset` of the frame and the target at `target_offset` of the
// target memory. Returns whether any chunk changes an element.
bool patch_table(const void* encoding, int64_t bytes, int64_t elements, int element_bytes,
                 const std::string& what, int64_t encoding_offset, int64_t target_offset,
                 std::vector<PatchChunk>& out);
// Appends the HashChunks of an item of `elements` elements at
// `target_offset` whose digest seed is `seed`.
void hash_table(int64_t elements, int element_bytes, uint64_t seed, int64_t target_offset,
                std::vector<HashChunk>& out);

// The tables run on the host, as the kernel runs them (what the CPU tests
// check the tables with): patches `target` from `frame`, and the digest sum
// of the chunks hashed in `target`.
void execute_patch_host(const std::vector<PatchChunk>& patch, const char* frame, char* target);
uint64_t execute_hash_host(const std::vector<HashChunk>& hash, const char* target);

}  // namespace weightsync::delta
