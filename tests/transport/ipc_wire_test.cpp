// cuda_ipc's control messages and channel: every message survives encoding,
// malformed packets are refused, descriptors pass through a socket, a closed
// peer reads as end-of-file, and a full socket keeps packets in order.
#include "transport/cuda_ipc/ipc_wire.h"
#include "transport/cuda_ipc/ipc_socket.h"

#include <weightsync/error.h>

#include <gtest/gtest.h>

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

namespace weightsync::transport_test {
namespace {

namespace ipc = weightsync::transport::cuda_ipc;

template <class T>
T round_trip(const T& m) {
  const ipc::Message back = ipc::decode(ipc::encode(m));
  EXPECT_TRUE(std::holds_alternative<T>(back)) << ipc::message_name(back);
  return std::get<T>(back);
}

TEST(IpcWire, EveryMessageRoundTrips) {
  const auto h = round_trip(ipc::Hello{3, 8, 0xABCDEF0123ull, "world/a"});
  EXPECT_EQ(h.rank, 3);
  EXPECT_EQ(h.world, 8);
  EXPECT_EQ(h.instance, 0xABCDEF0123ull);
  EXPECT_EQ(h.prefix, "world/a");
  ipc::RegionMsg region{7, 2, 1ull << 34, 99, 0x7f0000000000ull, {1, 2, 3, 4}, 7200, 450};
  const auto r = round_trip(region);
  EXPECT_EQ(r.region_id, 7u);
  EXPECT_EQ(r.kind, 2u);
  EXPECT_EQ(r.bytes, 1ull << 34);
  EXPECT_EQ(r.exporter, 99u);
  EXPECT_EQ(r.base, 0x7f0000000000ull);
  EXPECT_EQ(r.handle, (std::vector<uint8_t>{1, 2, 3, 4}));
  EXPECT_EQ(r.handle_bytes, 7200u);
  EXPECT_EQ(r.fd_count, 450u);
  const auto more = round_trip(ipc::RegionMore{5, {9, 8}});
  EXPECT_EQ(more.region_id, 5u);
  EXPECT_EQ(more.handle, (std::vector<uint8_t>{9, 8}));
  EXPECT_EQ(round_trip(ipc::Release{6}).region_id, 6u);
  EXPECT_EQ(round_trip(ipc::Released{8}).region_id, 8u);
  const auto p = round_trip(ipc::RecvPosted{11, ~Tag{0}, 7, 4096, 1 << 20});
  EXPECT_EQ(p.recv_id, 11u);
  EXPECT_EQ(p.tag, ~Tag{0});
  EXPECT_EQ(p.region_id, 7u);
  EXPECT_EQ(p.offset, 4096u);
  EXPECT_EQ(p.capacity, 1u << 20);
  EXPECT_EQ(round_trip(ipc::Cancel{12}).recv_id, 12u);
  EXPECT_EQ(round_trip(ipc::Cancelled{13}).recv_id, 13u);
  const auto c = round_trip(ipc::Complete{14, ipc::CompleteStatus::sender_failed, 5, "boom"});
  EXPECT_EQ(c.recv_id, 14u);
  EXPECT_EQ(c.status, ipc::CompleteStatus::sender_failed);
  EXPECT_EQ(c.bytes, 5u);
  EXPECT_EQ(c.error, "boom");
}

// `bytes` refused by decode() (or, with `batch`, by split_batch()) with an
// Errc::protocol whose message holds `part`.
void expect_protocol_error(const std::vector<uint8_t>& bytes, const std::string& part,
                           bool batch = false) {
  try {
    if (batch)
      ipc::split_batch(bytes);
    else
      ipc::decode(bytes);
    ADD_FAILURE() << "read a malformed packet (expected '" << part << "')";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::protocol) << e.what();
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(IpcWire, MalformedPacketsAreProtocolErrors) {
  const auto good = ipc::encode(ipc::RecvPosted{1, 2, 3, 4, 5});
  for (std::size_t n = 0; n < good.size(); ++n)
    expect_protocol_error(std::vector<uint8_t>(good.begin(), good.begin() + n), "malformed");
  auto longer = good;
  longer.push_back(0);
  expect_protocol_error(longer, "left over");
  auto magic = good;
  magic[0] ^= 1;
  expect_protocol_error(magic, "magic");
  auto version = good;
  version[4] = 9;
  expect_protocol_error(version, "version 9");
  auto type = good;
  type[6] = 77;
  expect_protocol_error(type, "unknown message type 77");
  auto status = ipc::encode(ipc::Complete{1, ipc::CompleteStatus::ok, 0, ""});
  status[16] = 9;  // after header (8) and receive id (8)
  expect_protocol_error(status, "status 9");
}

TEST(IpcWire, ExposeCarriesItsEntriesAndRefusesMoreThanItsTotalOrASlice) {
  ipc::Expose m{21, Tag{0x123456789}, 5, {{3, 64, 4096}, {0, 0, 0}, {9, 1ull << 33, 7}}};
  const auto e = round_trip(m);
  EXPECT_EQ(e.expose_id, 21u);
  EXPECT_EQ(e.tag, Tag{0x123456789});
  EXPECT_EQ(e.total, 5u);
  EXPECT_EQ(e.entries, m.entries);
  EXPECT_TRUE(round_trip(ipc::Expose{22, 1, 0, {}}).entries.empty());
  // A count beyond the total, or beyond a slice, is refused before anything
  // is allocated for it; so is a packet that ends inside its entries.
  m.total = 2;
  expect_protocol_error(ipc::encode(m), "3 entries of 2");
  ipc::Expose big{23, 1, 5000, std::vector<ipc::ExposeEntry>(ipc::kExposeSlice + 1)};
  expect_protocol_error(ipc::encode(big), "at most 2048 a packet");
  m.total = 5;
  auto cut = ipc::encode(m);
  cut.resize(cut.size() - 8);
  expect_protocol_error(cut, "entry bytes");
}

TEST(IpcWire, BatchesCarryTheirMessagesInOrderAndMalformedOnesAreRefused) {
  const std::vector<std::vector<uint8_t>> messages = {
      ipc::encode(ipc::RecvPosted{1, 7, 3, 0, 64}),
      ipc::encode(ipc::Complete{2, ipc::CompleteStatus::sender_failed, 0, "why"}),
      ipc::encode(ipc::Cancel{3})};
  const auto batch = ipc::encode_batch(messages);
  EXPECT_TRUE(ipc::is_batch(batch));
  EXPECT_FALSE(ipc::is_batch(messages[0]));
  EXPECT_EQ(batch.size(), ipc::kBatchHeaderBytes + 3 * ipc::kBatchEntryBytes + messages[0].size() +
                              messages[1].size() + messages[2].size());
  EXPECT_EQ(ipc::split_batch(batch), messages);
  // A single message is its own packet.
  EXPECT_EQ(ipc::split_batch(messages[1]), std::vector<std::vector<uint8_t>>{messages[1]});
  EXPECT_EQ(std::get<ipc::Cancel>(ipc::decode(ipc::split_batch(batch)[2])).recv_id, 3u);

  auto refused = [](const std::vector<uint8_t>& bytes, const std::string& part) {
    expect_protocol_error(bytes, part, true);
  };
  for (std::size_t n = 8; n < batch.size(); ++n)
    refused(std::vector<uint8_t>(batch.begin(), batch.begin() + n), "malformed");
  auto longer = batch;
  longer.push_back(0);
  refused(longer, "left over");
  auto count = batch;
  count[8] = 0;
  refused(count, "no message");
  count[8] = 0xFF, count[9] = 0xFF;
  refused(count, "65535 messages");
  auto version = batch;
  version[4] = 9;
  refused(version, "version 9");
  // A batch inside a batch is not a message.
  const auto nested = ipc::encode_batch({batch, messages[0]});
  EXPECT_EQ(ipc::split_batch(nested).size(), 2u);
  expect_protocol_error(ipc::split_batch(nested)[0], "batch packet inside a batch");
  EXPECT_THROW(ipc::encode_batch({}), Error);
}

std::pair<ipc::Connection, ipc::Connection> socket_pair() {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds), 0);
  return {ipc::Connection(ipc::UniqueFd(fds[0])), ipc::Connection(ipc::UniqueFd(fds[1]))};
}

TEST(IpcChannel, PassesDescriptorsWithAPacket) {
  auto [a, b] = socket_pair();
  auto owner = std::make_shared<std::vector<ipc::UniqueFd>>();
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  owner->emplace_back(pipe_fds[0]);
  owner->emplace_back(pipe_fds[1]);
  a.send(ipc::OutPacket{{1, 2, 3}, owner, {pipe_fds[0], pipe_fds[1]}});
  ipc::InPacket in;
  ASSERT_TRUE(b.receive(in));
  EXPECT_EQ(in.bytes, (std::vector<uint8_t>{1, 2, 3}));
  ASSERT_EQ(in.fds.size(), 2u);
  // The received write end feeds the original read end: the same pipe.
  ASSERT_EQ(::write(in.fds[1].get(), "x", 1), 1);
  char c = 0;
  EXPECT_EQ(::read(pipe_fds[0], &c, 1), 1);
  EXPECT_EQ(c, 'x');
  EXPECT_FALSE(b.receive(in)) << "nothing more waits";
}

TEST(IpcChannel, ClosedPeerReadsAsEndOfFileAfterItsLastPackets) {
  auto [a, b] = socket_pair();
  a.send(ipc::OutPacket{{9}, nullptr, {}});
  a.close();
  ipc::InPacket in;
  ASSERT_TRUE(b.receive(in)) << "packets sent before the close still arrive";
  EXPECT_EQ(in.bytes, std::vector<uint8_t>{9});
  try {
    b.receive(in);
    FAIL() << "end-of-file not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::io);
    EXPECT_NE(std::string(e.what()).find("closed the connection"), std::string::npos) << e.what();
  }
  EXPECT_THROW(b.send(ipc::OutPacket{{1}, nullptr, {}}), Error);
}

TEST(IpcChannel, FullSocketKeepsPacketsInOrderUntilFlushed) {
  auto [a, b] = socket_pair();
  // Fill the socket until packets wait in the outbox, then some more.
  std::vector<uint8_t> payload(1000);
  int sent = 0;
  while (a.idle() && sent < 100000) {
    payload[0] = static_cast<uint8_t>(sent);
    payload[1] = static_cast<uint8_t>(sent >> 8);
    payload[2] = static_cast<uint8_t>(sent >> 16);
    a.send(ipc::OutPacket{payload, nullptr, {}});
    ++sent;
  }
  ASSERT_FALSE(a.idle()) << "the socket never filled";
  for (int k = 0; k < 10; ++k, ++sent) {
    payload[0] = static_cast<uint8_t>(sent);
    payload[1] = static_cast<uint8_t>(sent >> 8);
    payload[2] = static_cast<uint8_t>(sent >> 16);
    a.send(ipc::OutPacket{payload, nullptr, {}});
  }
  ipc::InPacket in;
  int got = 0;
  while (got < sent) {
    if (!b.receive(in)) {
      a.flush();
      continue;
    }
    ASSERT_EQ(in.bytes[0] | in.bytes[1] << 8 | in.bytes[2] << 16, got) << "out of order";
    ++got;
  }
  EXPECT_TRUE(a.flush());
}

TEST(IpcChannel, ConnectingWhereNobodyListensIsAPeerFailure) {
  std::string address;
  {
    ipc::Listener gone("");
    address = gone.address();
  }
  try {
    ipc::connect_to(address, "rank 5");
    FAIL() << "connected to a closed listener";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::peer_failure);
    EXPECT_NE(std::string(e.what()).find("rank 5"), std::string::npos) << e.what();
  }
}

TEST(IpcChannel, ListenerAcceptsAndPathSocketsAreRemoved) {
  char dir[] = "/tmp/ws-ipc-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  std::string path;
  {
    ipc::Listener l(dir);
    path = l.address();
    EXPECT_EQ(path.rfind(dir, 0), 0u);
    ipc::Connection c(ipc::connect_to(path, "test"));
    ipc::UniqueFd accepted;
    for (int i = 0; i < 1000 && !accepted; ++i) accepted = l.accept();
    ASSERT_TRUE(accepted);
    c.send(ipc::OutPacket{{4}, nullptr, {}});
    ipc::Connection s(std::move(accepted));
    ipc::InPacket in;
    ASSERT_TRUE(s.receive(in));
    EXPECT_EQ(in.bytes, std::vector<uint8_t>{4});
  }
  struct stat st;
  EXPECT_NE(::stat(path.c_str(), &st), 0) << "socket file left behind";
  ::rmdir(dir);
}

}  // namespace
}  // namespace weightsync::transport_test
