#include "ipc_wire.h"

#include <weightsync/error.h>

#include <cstring>
#include <type_traits>

namespace weightsync::transport::cuda_ipc {
namespace {

// Strings and handles are short; the limit keeps a corrupt length harmless.
constexpr uint32_t kMaxBlob = 4096;

class Writer {
 public:
  template <class T>
  void put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out_.insert(out_.end(), p, p + sizeof(T));
  }
  void blob(const void* data, std::size_t n) {
    put(static_cast<uint32_t>(n));
    const auto* p = static_cast<const uint8_t*>(data);
    out_.insert(out_.end(), p, p + n);
  }
  void str(const std::string& s) { blob(s.data(), s.size()); }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

class Reader {
 public:
  explicit Reader(const std::vector<uint8_t>& in) : in_(in) {}
  template <class T>
  T get(const char* field) {
    need(sizeof(T), field);
    T v;
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::vector<uint8_t> blob(const char* field) {
    const auto n = get<uint32_t>(field);
    if (n > kMaxBlob)
      fail(Errc::protocol, "cuda_ipc: malformed packet: ", field, " of ", n, " bytes");
    return bytes(n, field);
  }
  // A length, then that many bytes, bounded only by the packet.
  std::vector<uint8_t> blob_unbounded(const char* field) {
    return bytes(get<uint32_t>(field), field);
  }
  std::vector<uint8_t> bytes(uint32_t n, const char* field) {
    need(n, field);
    std::vector<uint8_t> v(in_.begin() + pos_, in_.begin() + pos_ + n);
    pos_ += n;
    return v;
  }
  std::string str(const char* field) {
    auto v = blob(field);
    return std::string(v.begin(), v.end());
  }
  void end(const char* what) const {
    if (pos_ != in_.size())
      fail(Errc::protocol, "cuda_ipc: malformed ", what, " packet: ", in_.size() - pos_,
           " bytes left over");
  }

 private:
  void need(std::size_t n, const char* field) const {
    if (in_.size() - pos_ < n)
      fail(Errc::protocol, "cuda_ipc: malformed packet: it ends inside ", field, " (", in_.size(),
           " bytes)");
  }
  const std::vector<uint8_t>& in_;
  std::size_t pos_ = 0;
};

void put_fields(Writer& w, const Hello& m) {
  w.put(m.rank);
  w.put(m.world);
  w.put(m.instance);
  w.str(m.prefix);
}
void put_fields(Writer& w, const RegionMsg& m) {
  w.put(m.region_id);
  w.put(m.kind);
  w.put(m.bytes);
  w.put(m.exporter);
  w.put(m.base);
  w.blob(m.handle.data(), m.handle.size());
  w.put(m.handle_bytes);
  w.put(m.fd_count);
}
void put_fields(Writer& w, const RegionMore& m) {
  w.put(m.region_id);
  w.blob(m.handle.data(), m.handle.size());
}
void put_fields(Writer& w, const Release& m) {
  w.put(m.region_id);
}
void put_fields(Writer& w, const Released& m) {
  w.put(m.region_id);
}
void put_fields(Writer& w, const RecvPosted& m) {
  w.put(m.recv_id);
  w.put(m.tag);
  w.put(m.region_id);
  w.put(m.offset);
  w.put(m.capacity);
}
void put_fields(Writer& w, const Cancel& m) {
  w.put(m.recv_id);
}
void put_fields(Writer& w, const Cancelled& m) {
  w.put(m.recv_id);
}
void put_fields(Writer& w, const Complete& m) {
  w.put(m.recv_id);
  w.put(static_cast<uint32_t>(m.status));
  w.put(m.bytes);
  w.str(m.error);
}

void put_fields(Writer& w, const Expose& m) {
  w.put(m.expose_id);
  w.put(m.tag);
  w.put(m.total);
  w.put(static_cast<uint32_t>(m.entries.size()));
  for (const ExposeEntry& e : m.entries) {
    w.put(e.region_id);
    w.put(e.offset);
    w.put(e.bytes);
  }
}

// The fields of each message, read in the order put_fields writes them.
void get_fields(Reader& r, Hello& m) {
  m.rank = r.get<int32_t>("rank");
  m.world = r.get<int32_t>("world");
  m.instance = r.get<uint64_t>("instance");
  m.prefix = r.str("prefix");
}
void get_fields(Reader& r, RegionMsg& m) {
  m.region_id = r.get<uint64_t>("region id");
  m.kind = r.get<uint32_t>("handle kind");
  m.bytes = r.get<uint64_t>("region size");
  m.exporter = r.get<uint64_t>("exporter");
  m.base = r.get<uint64_t>("base");
  m.handle = r.blob("handle");
  m.handle_bytes = r.get<uint32_t>("handle size");
  m.fd_count = r.get<uint32_t>("descriptor count");
}
void get_fields(Reader& r, RegionMore& m) {
  m.region_id = r.get<uint64_t>("region id");
  m.handle = r.blob("handle");
}
void get_fields(Reader& r, Release& m) {
  m.region_id = r.get<uint64_t>("region id");
}
void get_fields(Reader& r, Released& m) {
  m.region_id = r.get<uint64_t>("region id");
}
void get_fields(Reader& r, RecvPosted& m) {
  m.recv_id = r.get<uint64_t>("receive id");
  m.tag = r.get<Tag>("tag");
  m.region_id = r.get<uint64_t>("region id");
  m.offset = r.get<uint64_t>("offset");
  m.capacity = r.get<uint64_t>("capacity");
}
void get_fields(Reader& r, Cancel& m) {
  m.recv_id = r.get<uint64_t>("receive id");
}
void get_fields(Reader& r, Cancelled& m) {
  m.recv_id = r.get<uint64_t>("receive id");
}
void get_fields(Reader& r, Complete& m) {
  m.recv_id = r.get<uint64_t>("receive id");
  const auto status = r.get<uint32_t>("status");
  if (status > static_cast<uint32_t>(CompleteStatus::declined))
    fail(Errc::protocol, "cuda_ipc: malformed complete packet: status ", status);
  m.status = static_cast<CompleteStatus>(status);
  m.bytes = r.get<uint64_t>("bytes");
  m.error = r.str("error");
}
void get_fields(Reader& r, Expose& m) {
  m.expose_id = r.get<uint64_t>("expose id");
  m.tag = r.get<Tag>("tag");
  m.total = r.get<uint32_t>("entry total");
  const auto count = r.get<uint32_t>("entry count");
  if (count > kExposeSlice || count > m.total)
    fail(Errc::protocol, "cuda_ipc: malformed expose packet: ", count, " entries of ", m.total,
         " (at most ", kExposeSlice, " a packet)");
  m.entries.resize(count);
  for (ExposeEntry& e : m.entries) {
    e.region_id = r.get<uint64_t>("entry region id");
    e.offset = r.get<uint64_t>("entry offset");
    e.bytes = r.get<uint64_t>("entry bytes");
  }
}

template <class T>
Message read_as(Reader& r) {
  T m;
  get_fields(r, m);
  return m;
}

// A message's type on the wire is its index in Message.
Message read_fields(Reader& r, uint16_t type) {
  switch (type) {
    case 0:
      return read_as<Hello>(r);
    case 1:
      return read_as<RegionMsg>(r);
    case 2:
      return read_as<RegionMore>(r);
    case 3:
      return read_as<Release>(r);
    case 4:
      return read_as<RecvPosted>(r);
    case 5:
      return read_as<Cancel>(r);
    case 6:
      return read_as<Cancelled>(r);
    case 7:
      return read_as<Complete>(r);
    case 8:
      return read_as<Released>(r);
    case 9:
      return read_as<Expose>(r);
    default:
      fail(Errc::protocol, "cuda_ipc: unknown message type ", type);
  }
}

}  // namespace

std::vector<uint8_t> encode(const Message& message) {
  Writer w;
  w.put(kWireMagic);
  w.put(kWireVersion);
  w.put(static_cast<uint16_t>(message.index()));
  std::visit([&](const auto& m) { put_fields(w, m); }, message);
  return w.take();
}

Message decode(const std::vector<uint8_t>& bytes) {
  Reader r(bytes);
  const auto magic = r.get<uint32_t>("magic");
  if (magic != kWireMagic)
    fail(Errc::protocol, "cuda_ipc: packet without the protocol's magic (0x", std::hex, magic, ")");
  const auto version = r.get<uint16_t>("version");
  if (version != kWireVersion)
    fail(Errc::protocol, "cuda_ipc: peer speaks protocol version ", version, ", this is ",
         kWireVersion, " (mixed weightsync builds?)");
  const auto type = r.get<uint16_t>("type");
  if (type == kBatchType)
    fail(Errc::protocol, "cuda_ipc: a batch packet inside a batch (", bytes.size(), " bytes)");
  Message m = read_fields(r, type);
  r.end(message_name(m));
  return m;
}

std::vector<uint8_t> encode_batch(const std::vector<std::vector<uint8_t>>& messages) {
  if (messages.empty()) fail(Errc::internal, "cuda_ipc: an empty batch");
  Writer w;
  w.put(kWireMagic);
  w.put(kWireVersion);
  w.put(kBatchType);
  w.put(static_cast<uint32_t>(messages.size()));
  for (const auto& m : messages) w.blob(m.data(), m.size());
  return w.take();
}

bool is_batch(const std::vector<uint8_t>& packet) {
  uint16_t type = 0;
  if (packet.size() >= 8) std::memcpy(&type, packet.data() + 6, sizeof(type));
  return type == kBatchType;
}

std::vector<std::vector<uint8_t>> split_batch(std::vector<uint8_t> packet) {
  std::vector<std::vector<uint8_t>> out;
  if (!is_batch(packet)) {
    out.push_back(std::move(packet));
    return out;
  }
  Reader r(packet);
  const auto magic = r.get<uint32_t>("magic");
  const auto version = r.get<uint16_t>("version");
  if (magic != kWireMagic || version != kWireVersion) decode(packet);  // throws, naming which
  r.get<uint16_t>("type");
  const auto count = r.get<uint32_t>("batch count");
  if (count == 0) fail(Errc::protocol, "cuda_ipc: malformed batch packet: no message in it");
  // Each message takes at least its length and a header: a count beyond what
  // the packet can hold is refused before anything is allocated for it.
  if (count > packet.size() / (kBatchEntryBytes + 8))
    fail(Errc::protocol, "cuda_ipc: malformed batch packet: ", count, " messages in ",
         packet.size(), " bytes");
  out.reserve(count);
  for (uint32_t i = 0; i < count; ++i) out.push_back(r.blob_unbounded("batch message"));
  r.end("batch");
  return out;
}

const char* message_name(const Message& message) {
  static const char* const names[] = {"hello",       "region", "region_more", "release",
                                      "recv_posted", "cancel", "cancelled",   "complete",
                                      "released",    "expose"};
  return names[message.index()];
}

}  // namespace weightsync::transport::cuda_ipc
