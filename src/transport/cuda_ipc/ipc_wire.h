// The cuda_ipc control messages and their encoding: one message per packet,
// a fixed header (magic, version, type) then fixed-width fields in the host's
// byte order (both ends run on one machine). Decoding checks every length and
// throws Errc::protocol naming what was malformed.
//
// Between a receiver R and a sender S of one pair (each direction of the pair
// has its own connection, written only by its connecting side):
//   hello        first packet on a connection: who connects (rank, instance)
//   region       R -> S: region id, handle kind, size, handle bytes; the
//                descriptors of a POSIX-fd handle ride along; a long handle
//                (a VMM chunk table) and many descriptors continue in
//                region_more packets
//   release      R -> S: a region is gone (freed, deregistered): unmap it
//   released     S -> R: it is unmapped (legacy cudaIpc memory must not be
//                freed while another process has it open)
//   recv_posted  R -> S: receive `recv_id` with `tag` waits at `offset` of
//                `region` for at most `capacity` bytes
//   cancel       R -> S: withdraw receive `recv_id` unless a send took it
//   cancelled    S -> R: it was withdrawn; no send will write into it
//   complete     S -> R: receive `recv_id` got `bytes` (status ok), or the
//                message was too large / the sender failed (no data written
//                in either case)
//   expose       R -> S: memory lent under `tag` (Transport::expose): its
//                id (from the receives' id space), the number of entries in
//                all and some of them, each a (region, offset, bytes) of an
//                announced region; a long list continues in further expose
//                messages with the same id. S answers with a complete for
//                that id once it mapped them all (ok), could not
//                (sender_failed) or would not (declined); R may cancel it
//                as it cancels a receive.
//
// Batches: messages without descriptors that a side queues between two
// flushes (the receives posted in one go, the completions of one progress
// pass) travel together in batch packets, so many receives and completions
// cost one write and one read. A batch never nests and never passes
// descriptors; messages that pass descriptors go alone, in order with the rest.
#pragma once

#include <weightsync/backend/transport.h>

#include "ipc_socket.h"

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace weightsync::transport::cuda_ipc {

constexpr uint32_t kWireMagic = 0x50495357;  // "WSIP"
constexpr uint16_t kWireVersion = 3;         // 2: batch packets; 3: expose

struct Hello {
  int32_t rank = 0;
  int32_t world = 0;
  uint64_t instance = 0;  // the connecting transport's random id
  std::string prefix;     // the world's store prefix, so worlds never mix
};

// Handle bytes per packet (a VMM chunk table can be long).
constexpr std::size_t kHandleSlice = 2048;

struct RegionMsg {
  uint64_t region_id = 0;
  uint32_t kind = 0;  // IpcMemory's handle kind
  uint64_t bytes = 0;
  uint64_t exporter = 0;  // the exporting process's id (a mapping in the same process is direct)
  uint64_t base = 0;      // the region's address in the exporter
  std::vector<uint8_t> handle;  // its first slice
  uint32_t handle_bytes = 0;    // the handle's size in all
  uint32_t fd_count = 0;        // descriptors in all, with those of region_more packets
};

struct RegionMore {
  uint64_t region_id = 0;
  std::vector<uint8_t> handle;  // the next slice of the handle, maybe empty
};

struct Release {
  uint64_t region_id = 0;
};

struct Released {
  uint64_t region_id = 0;
};

struct RecvPosted {
  uint64_t recv_id = 0;
  Tag tag = 0;
  uint64_t region_id = 0;  // 0 for a zero-byte receive (no memory)
  uint64_t offset = 0;
  uint64_t capacity = 0;
};

struct Cancel {
  uint64_t recv_id = 0;
};

struct Cancelled {
  uint64_t recv_id = 0;
};

// declined: a loan (expose) the sender chose not to map.
enum class CompleteStatus : uint32_t { ok = 0, too_large = 1, sender_failed = 2, declined = 3 };

struct Complete {
  uint64_t recv_id = 0;
  CompleteStatus status = CompleteStatus::ok;
  uint64_t bytes = 0;  // what arrived; for too_large, the message's size
  std::string error;   // sender_failed: why
};

struct ExposeEntry {
  uint64_t region_id = 0;  // 0 for an empty buffer
  uint64_t offset = 0;
  uint64_t bytes = 0;
  bool operator==(const ExposeEntry&) const = default;
};

// Entries per expose message (24 bytes each: a slice fits a packet).
constexpr std::size_t kExposeSlice = 2048;

struct Expose {
  uint64_t expose_id = 0;
  Tag tag = 0;
  uint32_t total = 0;  // entries in all, over every message of this id
  std::vector<ExposeEntry> entries;
};

// New types go at the end: a message's type on the wire is its index here.
using Message = std::variant<Hello, RegionMsg, RegionMore, Release, RecvPosted, Cancel, Cancelled,
                             Complete, Released, Expose>;

std::vector<uint8_t> encode(const Message& message);
// Errc::protocol for a malformed packet (bad magic, version, type or length).
Message decode(const std::vector<uint8_t>& bytes);
const char* message_name(const Message& message);

// A batch packet: magic, version, kBatchType, a u32 count, then per message
// its u32 length and its encoded bytes.
constexpr uint16_t kBatchType = 0xFFFF;
constexpr std::size_t kBatchHeaderBytes = 12;
constexpr std::size_t kBatchEntryBytes = 4;  // each message's length
bool is_batch(const std::vector<uint8_t>& packet);
// The batch of `messages` (each one encode()d; at least one).
std::vector<uint8_t> encode_batch(const std::vector<std::vector<uint8_t>>& messages);
// The encoded messages a packet holds: the packet itself when it holds one
// message, each message of a batch otherwise. Errc::protocol for a malformed
// batch (a length past its end, a count that does not match, bytes left over).
std::vector<std::vector<uint8_t>> split_batch(std::vector<uint8_t> packet);

}  // namespace weightsync::transport::cuda_ipc
