// The cuda_ipc protocol between two PeerLinks in one process (see
// ipc_fake_memory.h): matching, sizes, cancels that cross completions, copy
// and import failures, peer loss, region export and release. The same
// protocol over real processes and sockets is in ipc_scenarios_test.cpp.
#include "ipc_fake_memory.h"

#include <gtest/gtest.h>

#include <numeric>

namespace weightsync::transport_test {
namespace {

using Kind = Request::Kind;

// An owned host buffer declared to the receiving side's fake memory.
struct Block {
  Block(LinkPair& pair, int side, std::size_t bytes, uint64_t id = 1) : bytes(bytes, 0) {
    pair.memory[side].allocation(this->bytes.data(), bytes, id);
  }
  void* data() { return bytes.data(); }
  std::vector<uint8_t> bytes;
};

std::vector<uint8_t> pattern(std::size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  std::iota(v.begin(), v.end(), seed);
  return v;
}

std::string error_of(const ipc::IpcOp& op) {
  return op.error ? op.error->second : "";
}

// What a side wrote, message by message, in packet order.
std::vector<std::string> message_names(const std::deque<ipc::OutPacket>& wire) {
  std::vector<std::string> names;
  for (const auto& packet : wire)
    for (const auto& m : ipc::split_batch(packet.bytes))
      names.push_back(ipc::message_name(ipc::decode(m)));
  return names;
}

TEST(IpcProtocol, SendPostedBeforeItsReceiveWaitsAndIsThenDelivered) {
  LinkPair p;
  Block in(p, 0, 64);
  const auto out = pattern(64, 3);
  auto s = p.send(1, 5, out.data(), out.size());
  p.pump();
  EXPECT_FALSE(s->done);
  auto r = p.recv(0, 5, in.data(), 64);
  p.pump();
  ASSERT_TRUE(s->done && r->done);
  EXPECT_FALSE(s->error || r->error) << error_of(*s) << error_of(*r);
  EXPECT_EQ(r->transferred, 64u);
  EXPECT_EQ(in.bytes, out);
}

TEST(IpcProtocol, SameTagMatchesInPostingOrderAndTagsAreIndependent) {
  LinkPair p;
  Block a(p, 0, 4096, 1), b(p, 0, 4096, 2);
  std::vector<std::vector<uint8_t>> out;
  std::vector<std::shared_ptr<ipc::IpcOp>> sends, recvs;
  for (int i = 0; i < 4; ++i) out.push_back(pattern(100 + i, static_cast<uint8_t>(i)));
  for (int i = 0; i < 4; ++i) sends.push_back(p.send(1, i % 2 ? 8 : 7, out[i].data(), 100 + i));
  // Tag 8 first, into the second block: receives of a tag take its sends in order.
  recvs.push_back(p.recv(0, 8, b.data(), 1000));
  recvs.push_back(p.recv(0, 8, static_cast<uint8_t*>(b.data()) + 1000, 1000));
  recvs.push_back(p.recv(0, 7, a.data(), 1000));
  recvs.push_back(p.recv(0, 7, static_cast<uint8_t*>(a.data()) + 1000, 1000));
  p.pump();
  const uint8_t* where[] = {a.bytes.data(), b.bytes.data(), a.bytes.data() + 1000,
                            b.bytes.data() + 1000};
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(sends[i]->done && !sends[i]->error) << error_of(*sends[i]);
    EXPECT_EQ(std::vector<uint8_t>(where[i], where[i] + 100 + i), out[i]) << "message " << i;
  }
  EXPECT_EQ(recvs[0]->transferred, 101u);
  EXPECT_EQ(recvs[1]->transferred, 103u);
  EXPECT_EQ(recvs[2]->transferred, 100u);
  EXPECT_EQ(recvs[3]->transferred, 102u);
}

TEST(IpcProtocol, ReceivesPostedFirstAreTakenInTheirPostingOrder) {
  LinkPair p;
  Block in(p, 0, 3000);
  std::vector<std::shared_ptr<ipc::IpcOp>> recvs;
  for (int i = 0; i < 3; ++i)
    recvs.push_back(p.recv(0, 9, static_cast<uint8_t*>(in.data()) + 1000 * i, 1000));
  p.pump();  // all three wait at the sender before any send
  std::vector<std::vector<uint8_t>> out;
  for (int i = 0; i < 3; ++i) out.push_back(pattern(10 + i, static_cast<uint8_t>(40 * i)));
  for (int i = 0; i < 3; ++i) p.send(1, 9, out[i].data(), out[i].size());
  p.pump();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(recvs[i]->done && !recvs[i]->error) << error_of(*recvs[i]);
    EXPECT_EQ(recvs[i]->transferred, 10u + i) << "receive " << i;
    EXPECT_EQ(
        std::vector<uint8_t>(in.bytes.begin() + 1000 * i, in.bytes.begin() + 1000 * i + 10 + i),
        out[i]);
  }
}

TEST(IpcProtocol, SmallerMessageCompletesWithItsSize) {
  LinkPair p;
  Block in(p, 0, 1000);
  const auto out = pattern(10, 1);
  auto r = p.recv(0, 1, in.data(), 1000);
  auto s = p.send(1, 1, out.data(), 10);
  p.pump();
  ASSERT_TRUE(r->done && !r->error);
  EXPECT_EQ(r->transferred, 10u);
  EXPECT_EQ(s->transferred, 10u);
}

TEST(IpcProtocol, LargerMessageFailsBothSidesNamingBothSizesAndWritesNothing) {
  LinkPair p;
  Block in(p, 0, 100);
  const auto out = pattern(1000, 1);
  auto r = p.recv(0, 0x44c, in.data(), 100);
  auto s = p.send(1, 0x44c, out.data(), 1000);
  p.pump();
  ASSERT_TRUE(r->done && s->done);
  ASSERT_TRUE(r->error && s->error);
  EXPECT_EQ(r->error->first, Errc::mismatch);
  EXPECT_EQ(s->error->first, Errc::mismatch);
  EXPECT_NE(error_of(*r).find("1000 bytes"), std::string::npos) << error_of(*r);
  EXPECT_NE(error_of(*r).find("100-byte"), std::string::npos) << error_of(*r);
  EXPECT_NE(error_of(*s).find("rank 0"), std::string::npos) << error_of(*s);
  EXPECT_EQ(in.bytes, std::vector<uint8_t>(100, 0));
  EXPECT_TRUE(p.memory[1].copies.empty());
  // The pair goes on: the next message of the tag is matched normally.
  auto r2 = p.recv(0, 0x44c, in.data(), 100);
  auto s2 = p.send(1, 0x44c, out.data(), 50);
  p.pump();
  EXPECT_TRUE(r2->done && !r2->error && r2->transferred == 50);
}

TEST(IpcProtocol, ZeroByteMessageNeedsNoMemory) {
  LinkPair p;
  auto r = p.recv(0, 3, nullptr, 0);
  auto s = p.send(1, 3, nullptr, 0);
  p.pump();
  EXPECT_TRUE(r->done && !r->error && r->transferred == 0);
  EXPECT_TRUE(s->done && !s->error);
  EXPECT_EQ(p.memory[0].exports, 0);
}

TEST(IpcProtocol, CancelledReceiveIsWithdrawnAndTheNextOneGetsTheMessage) {
  LinkPair p;
  Block in(p, 0, 64);
  const auto out = pattern(64, 9);
  auto r1 = p.recv(0, 2, in.data(), 32);
  auto r2 = p.recv(0, 2, in.data(), 64);
  p.pump();
  p.link[0]->cancel(*r1);
  EXPECT_FALSE(r1->done) << "settled by the sender's answer, not locally";
  p.pump();
  ASSERT_TRUE(r1->done && r1->error);
  EXPECT_EQ(r1->error->first, Errc::cancelled);
  auto s = p.send(1, 2, out.data(), 64);
  p.pump();
  EXPECT_TRUE(s->done && !s->error) << error_of(*s);
  EXPECT_TRUE(r2->done && !r2->error && r2->transferred == 64);
  EXPECT_EQ(in.bytes, out);
}

TEST(IpcProtocol, CancelCrossingACompletionLetsTheReceiveComplete) {
  LinkPair p;
  p.memory[1].auto_complete = false;
  Block in(p, 0, 64);
  const auto out = pattern(64, 4);
  auto r = p.recv(0, 2, in.data(), 64);
  auto s = p.send(1, 2, out.data(), 64);
  p.pump();  // matched; the copy runs
  ASSERT_EQ(p.memory[1].copies.size(), 1u);
  p.link[0]->cancel(*r);
  p.link[1]->cancel(*s);  // a running copy cannot be withdrawn either
  p.memory[1].complete_next();
  p.pump();
  ASSERT_TRUE(r->done && s->done);
  EXPECT_FALSE(r->error) << error_of(*r);
  EXPECT_FALSE(s->error) << error_of(*s);
  EXPECT_EQ(in.bytes, out);
}

TEST(IpcProtocol, CancelledQueuedSendIsNeverDelivered) {
  LinkPair p;
  Block in(p, 0, 64);
  const auto first = pattern(8, 1), second = pattern(8, 50);
  auto s1 = p.send(1, 4, first.data(), 8);
  auto s2 = p.send(1, 4, second.data(), 8);
  p.link[1]->cancel(*s1);
  ASSERT_TRUE(s1->done && s1->error && s1->error->first == Errc::cancelled);
  auto r = p.recv(0, 4, in.data(), 8);
  p.pump();
  EXPECT_TRUE(s2->done && !s2->error);
  EXPECT_EQ(std::vector<uint8_t>(in.bytes.begin(), in.bytes.begin() + 8), second);
}

TEST(IpcProtocol, FailedCopyFailsBothSides) {
  LinkPair p;
  p.memory[1].auto_complete = false;
  Block in(p, 0, 64);
  const auto out = pattern(64, 4);
  auto r = p.recv(0, 6, in.data(), 64);
  auto s = p.send(1, 6, out.data(), 64);
  p.pump();
  p.memory[1].copies[0]->error = Error(Errc::transport, "cudaMemcpyAsync: an illegal address");
  p.pump();
  ASSERT_TRUE(r->error && s->error);
  EXPECT_EQ(s->error->first, Errc::transport);
  EXPECT_EQ(r->error->first, Errc::transport);
  EXPECT_NE(error_of(*r).find("illegal address"), std::string::npos) << error_of(*r);
  EXPECT_NE(error_of(*r).find("rank 1 could not write"), std::string::npos) << error_of(*r);
}

TEST(IpcProtocol, FailedImportFailsEverySendIntoThatRegion) {
  LinkPair p;
  p.memory[1].import_error = Error(Errc::transport, "cudaIpcOpenMemHandle: invalid handle");
  Block in(p, 0, 64);
  const auto out = pattern(16, 4);
  for (int i = 0; i < 2; ++i) {
    auto r = p.recv(0, 6, in.data(), 16);
    auto s = p.send(1, 6, out.data(), 16);
    p.pump();
    ASSERT_TRUE(r->error && s->error);
    EXPECT_NE(error_of(*s).find("invalid handle"), std::string::npos) << error_of(*s);
    EXPECT_NE(error_of(*r).find("mapping region"), std::string::npos) << error_of(*r);
  }
  EXPECT_EQ(p.memory[1].imports, 1) << "a failed import is not retried for every message";
}

TEST(IpcProtocol, LostPeerFailsEveryPendingOperation) {
  LinkPair p;
  p.memory[1].auto_complete = false;
  Block in(p, 1, 64), in0(p, 0, 64);
  const auto out = pattern(64, 4);
  auto r = p.recv(1, 1, in.data(), 64);        // rank 1 receives from rank 0
  auto queued = p.send(1, 2, out.data(), 64);  // no receive for it yet
  auto r0 = p.recv(0, 3, in0.data(), 64);
  auto running = p.send(1, 3, out.data(), 64);
  p.pump();
  ASSERT_EQ(p.memory[1].copies.size(), 1u);
  p.link[1]->lose("the connection was closed");
  EXPECT_FALSE(running->done) << "the device still reads its buffer until the copy is done";
  p.memory[1].complete_next();
  EXPECT_TRUE(p.link[1]->poll());
  EXPECT_FALSE(running->copy) << "released once done";
  EXPECT_FALSE(running->mapping);
  for (auto* op : {&r, &queued, &running}) {
    ASSERT_TRUE((*op)->done && (*op)->error);
    EXPECT_EQ((*op)->error->first, Errc::peer_failure);
    EXPECT_NE(error_of(**op).find("peer rank 0 failed (the connection was closed)"),
              std::string::npos)
        << error_of(**op);
  }
  EXPECT_EQ(p.link[1]->pending(), 0u);
  EXPECT_TRUE(p.wire[1].empty()) << "nothing is sent to a lost peer";
}

TEST(IpcProtocol, ARunningCopyEndsBeforeTheMemoryItWritesIsUnmapped) {
  {
    auto p = std::make_unique<LinkPair>();
    FakeMemory* sender = &p->memory[1];
    sender->auto_complete = false;
    Block in(*p, 0, 64);
    const auto out = pattern(64, 4);
    auto r = p->recv(0, 3, in.data(), 64);
    auto s = p->send(1, 3, out.data(), 64);
    p->pump();
    p->link[1]->lose("killed");
    // The link and the op go while the copy still runs.
    p->link[1].reset();
    s.reset();
    EXPECT_EQ(sender->mapped_when_copy_ended, std::vector<int>{1});
  }
}

TEST(IpcProtocol, DrainFailsSendsWhoseCopiesOutlastTheBound) {
  LinkPair p;
  p.memory[1].auto_complete = false;
  Block in(p, 0, 64);
  const auto out = pattern(64, 4);
  auto r = p.recv(0, 3, in.data(), 64);
  auto s = p.send(1, 3, out.data(), 64);
  p.pump();
  p.link[1]->lose("replaced by a new process");
  p.link[1]->drain(std::chrono::milliseconds(20));
  ASSERT_TRUE(s->done && s->error);
  EXPECT_EQ(s->error->first, Errc::peer_failure);
  EXPECT_TRUE(s->copy) << "the op keeps its copy, whose destructor waits for the device";
  EXPECT_EQ(p.link[1]->pending(), 0u);
}

TEST(IpcProtocol, RegionIsExportedAnnouncedAndImportedOnce) {
  LinkPair p;
  Block in(p, 0, 4096);
  const auto out = pattern(64, 4);
  for (int i = 0; i < 5; ++i) {
    auto r = p.recv(0, 1, static_cast<uint8_t*>(in.data()) + 64 * i, 64);
    auto s = p.send(1, 1, out.data(), 64);
    p.pump();
    ASSERT_TRUE(r->done && !r->error) << error_of(*r);
  }
  EXPECT_EQ(p.memory[0].exports, 1);
  EXPECT_EQ(p.memory[1].imports, 1);
  for (int i = 0; i < 5; ++i)
    EXPECT_EQ(std::vector<uint8_t>(in.bytes.begin() + 64 * i, in.bytes.begin() + 64 * (i + 1)),
              out);
}

TEST(IpcProtocol, ReusedAddressIsExportedAnewAndTheOldRegionReleased) {
  LinkPair p;
  Block in(p, 0, 256, /*id=*/1);
  const auto out = pattern(64, 4);
  auto run = [&] {
    auto r = p.recv(0, 1, in.data(), 64);
    auto s = p.send(1, 1, out.data(), 64);
    p.pump();
    ASSERT_TRUE(r->done && !r->error) << error_of(*r);
  };
  run();
  // The allocation was freed and a new one made at the same address.
  p.memory[0].allocation(in.data(), 256, /*id=*/2);
  run();
  EXPECT_EQ(p.memory[0].exports, 2);
  EXPECT_EQ(p.memory[1].imports, 2);
  EXPECT_EQ(p.released[0], std::vector<uint64_t>{1});
}

TEST(IpcProtocol, RegisteredRegionIsReleasedWithItsRegistration) {
  LinkPair p;
  Block in(p, 0, 256);
  const uint64_t id = p.exports[0]->pin(Buffer{in.data(), 256, MemoryKind::host, -1, nullptr});
  const auto out = pattern(64, 4);
  auto r = p.recv(0, 1, static_cast<uint8_t*>(in.data()) + 100, 64, id);
  auto s = p.send(1, 1, out.data(), 64);
  p.pump();
  ASSERT_TRUE(r->done && !r->error) << error_of(*r);
  EXPECT_EQ(std::vector<uint8_t>(in.bytes.begin() + 100, in.bytes.begin() + 164), out);
  p.exports[0]->unpin(id);
  EXPECT_TRUE(p.link[0]->releasing(id)) << "until the sender confirms it unmapped it";
  p.pump();
  EXPECT_FALSE(p.link[0]->releasing(id));
  EXPECT_EQ(p.released[0], std::vector<uint64_t>{id});
  // The sender dropped its mapping: a receive into the same memory exports it again.
  auto r2 = p.recv(0, 1, in.data(), 64);
  auto s2 = p.send(1, 1, out.data(), 64);
  p.pump();
  EXPECT_TRUE(r2->done && !r2->error) << error_of(*r2);
  EXPECT_EQ(p.memory[1].imports, 2);
}

TEST(IpcProtocol, ReleaseWaitsOnlyForMemoryThatMustBeUnmappedAndOnlyForResponsivePeers) {
  LinkPair p;
  Block in(p, 0, 256);
  const auto out = pattern(64, 4);
  auto use = [&](uint64_t id) {
    auto r = p.recv(0, 1, in.data(), 64, id);
    p.send(1, 1, out.data(), 64);
    p.pump();
    ASSERT_TRUE(r->done && !r->error) << error_of(*r);
  };
  // Memory a mapping keeps alive (VMM) is released without waiting.
  p.memory[0].unmap_before_free = false;
  const uint64_t vmm = p.exports[0]->pin(Buffer{in.data(), 256, MemoryKind::host, -1, nullptr});
  use(vmm);
  p.exports[0]->unpin(vmm);
  EXPECT_FALSE(p.link[0]->releasing(vmm));
  p.pump();
  // A peer that let a release wait out is not waited for until it answers one.
  p.memory[0].unmap_before_free = true;
  const uint64_t a = p.exports[0]->pin(Buffer{in.data(), 256, MemoryKind::host, -1, nullptr});
  use(a);
  p.exports[0]->unpin(a);
  EXPECT_TRUE(p.link[0]->releasing(a));
  p.link[0]->mark_slow();
  EXPECT_FALSE(p.link[0]->releasing(a));
  p.pump();  // it answers: waited for again
  const uint64_t b = p.exports[0]->pin(Buffer{in.data(), 256, MemoryKind::host, -1, nullptr});
  use(b);
  p.exports[0]->unpin(b);
  EXPECT_TRUE(p.link[0]->releasing(b));
}

TEST(IpcProtocol, HundredsOfDescriptorsAndALongHandleTravelInSeveralPackets) {
  LinkPair p;
  // A 9 GB expandable segment in 20 MB chunks: 450 descriptors, and a chunk
  // table of 16 bytes each.
  p.memory[0].fds_per_export = 450;
  p.memory[0].extra_handle_bytes = 450 * 16;
  Block in(p, 0, 64);
  const auto out = pattern(64, 4);
  auto r = p.recv(0, 1, in.data(), 64);
  p.link[0]->flush();
  // The region, then region_more packets (the handle in 2 KiB slices, with
  // 200, 200 and 50 descriptors); the last slice passes none and leaves in
  // one batch with the receive.
  ASSERT_EQ(p.wire[0].size(), 4u);
  EXPECT_EQ(message_names(p.wire[0]),
            (std::vector<std::string>{"region", "region_more", "region_more", "region_more",
                                      "recv_posted"}));
  auto s = p.send(1, 1, out.data(), 64);
  p.pump();
  EXPECT_TRUE(r->done && !r->error) << error_of(*r);
  EXPECT_EQ(p.memory[1].imported_fds, 450u);
  ASSERT_EQ(p.memory[1].imported_handles.size(), 1u);
  const auto& handle = p.memory[1].imported_handles[0];
  ASSERT_EQ(handle.size(), sizeof(uintptr_t) + 450 * 16);
  for (std::size_t i = 0; i < 450 * 16; ++i)
    ASSERT_EQ(handle[sizeof(uintptr_t) + i], static_cast<uint8_t>(i * 7)) << "byte " << i;
}

TEST(IpcProtocol, ReceivesPostedTogetherAndTheirCompletionsTravelInBatches) {
  // 3000 receives of 64 bytes: posted in one go, they leave in three packets
  // (each at most kMaxPacketBytes), and the sender's 3000 completions, found
  // in one pass, in two; every message arrives, bytes and all.
  constexpr int kCount = 3000;
  constexpr std::size_t kBytes = 64;
  LinkPair p;
  Block in(p, 0, kCount * kBytes);
  std::vector<std::shared_ptr<ipc::IpcOp>> recvs, sends;
  for (int i = 0; i < kCount; ++i)
    recvs.push_back(p.recv(0, 5, static_cast<uint8_t*>(in.data()) + i * kBytes, kBytes));
  EXPECT_EQ(p.wire[0].size(), 2u) << "full packets leave as they fill";
  EXPECT_GT(p.link[0]->queued(), 0u) << "the rest waits for the flush";
  p.link[0]->flush();
  EXPECT_EQ(p.link[0]->queued(), 0u);
  ASSERT_EQ(p.wire[0].size(), 3u);
  for (const auto& packet : p.wire[0]) EXPECT_LE(packet.bytes.size(), ipc::kMaxPacketBytes);
  const auto names = message_names(p.wire[0]);
  ASSERT_EQ(names.size(), kCount + 1u);
  EXPECT_EQ(names.front(), "region");
  EXPECT_EQ(names.back(), "recv_posted");

  const auto out = pattern(kCount * kBytes, 9);
  p.memory[1].auto_complete = false;
  for (int i = 0; i < kCount; ++i) sends.push_back(p.send(1, 5, out.data() + i * kBytes, kBytes));
  while (!p.wire[0].empty()) {  // the receives reach the sender: every copy starts
    ipc::OutPacket packet = std::move(p.wire[0].front());
    p.wire[0].pop_front();
    p.link[1]->on_packet(ipc::InPacket{std::move(packet.bytes), {}});
  }
  ASSERT_EQ(p.memory[1].copies.size(), static_cast<std::size_t>(kCount));
  for (int i = 0; i < kCount; ++i) p.memory[1].complete_next();
  EXPECT_TRUE(p.link[1]->poll());
  p.link[1]->flush();
  EXPECT_EQ(p.wire[1].size(), 2u) << "3000 completions of 36 bytes each";
  EXPECT_EQ(message_names(p.wire[1]), std::vector<std::string>(kCount, "complete"));
  p.pump();
  for (int i = 0; i < kCount; ++i) {
    ASSERT_TRUE(recvs[i]->done && !recvs[i]->error) << "receive " << i << error_of(*recvs[i]);
    ASSERT_TRUE(sends[i]->done && !sends[i]->error) << "send " << i << error_of(*sends[i]);
  }
  EXPECT_EQ(in.bytes, out);
}

Buffer slice(Block& b, std::size_t offset, std::size_t bytes) {
  return Buffer{static_cast<uint8_t*>(b.data()) + offset, bytes, MemoryKind::host, -1, nullptr};
}

TEST(IpcProtocol, LentMemoryIsMappedOnceAndWrittenThroughItsAddresses) {
  LinkPair p;
  Block a(p, 0, 4096, /*id=*/1), b(p, 0, 256, /*id=*/2);
  const std::vector<Buffer> lent{slice(a, 100, 1000), Buffer{}, slice(b, 16, 200),
                                 slice(a, 2000, 500)};
  // The map is posted before the loan reaches it, then a second loan
  // arrives before its map: both meet.
  for (const bool map_first : {true, false}) {
    SCOPED_TRACE(map_first ? "map posted first" : "loan first");
    std::vector<void*> addresses;
    std::shared_ptr<ipc::IpcOp> m, e;
    if (map_first) m = p.map(1, 7, &addresses);
    p.pump();
    e = p.expose(0, 7, lent);
    p.pump();
    if (!map_first) {
      EXPECT_FALSE(e->done) << "a loan completes once mapped";
      m = p.map(1, 7, &addresses);
      p.pump();
    }
    ASSERT_TRUE(m->done && !m->error) << error_of(*m);
    ASSERT_TRUE(e->done && !e->error) << error_of(*e);
    EXPECT_EQ(m->transferred, 1700u);
    EXPECT_EQ(e->transferred, 1700u);
    ASSERT_EQ(addresses.size(), 4u);
    // The fake memory maps a region at its own address: each address is
    // where the lent buffer lies.
    for (std::size_t i = 0; i < lent.size(); ++i) EXPECT_EQ(addresses[i], lent[i].data) << i;
  }
  EXPECT_EQ(p.memory[0].exports, 2) << "two regions, each exported once";
  EXPECT_EQ(p.memory[1].imports, 2) << "and mapped once";
  EXPECT_EQ(p.link[0]->pending() + p.link[1]->pending(), 0u);
}

TEST(IpcProtocol, LoansAndMapsMatchPerTagInPostingOrder) {
  LinkPair p;
  Block a(p, 0, 1024);
  auto first = p.expose(0, 1, {slice(a, 0, 8)});
  auto second = p.expose(0, 1, {slice(a, 8, 16), slice(a, 24, 8)});
  auto other = p.expose(0, 2, {slice(a, 512, 64)});
  p.pump();
  std::vector<void*> x, y, z;
  auto mz = p.map(1, 2, &z);
  auto mx = p.map(1, 1, &x);
  auto my = p.map(1, 1, &y);
  p.pump();
  for (auto* op : {&first, &second, &other, &mx, &my, &mz})
    ASSERT_TRUE((*op)->done && !(*op)->error) << error_of(**op);
  EXPECT_EQ(x, std::vector<void*>{a.bytes.data()});
  EXPECT_EQ(y, (std::vector<void*>{a.bytes.data() + 8, a.bytes.data() + 24}));
  EXPECT_EQ(z, std::vector<void*>{a.bytes.data() + 512});
}

TEST(IpcProtocol, ALongLoanTravelsInSeveralMessages) {
  constexpr std::size_t kCount = 5000;
  LinkPair p;
  Block a(p, 0, kCount * 8);
  std::vector<Buffer> lent;
  for (std::size_t i = 0; i < kCount; ++i) lent.push_back(slice(a, 8 * i, 8));
  auto e = p.expose(0, 3, lent);
  p.link[0]->flush();
  const auto names = message_names(p.wire[0]);
  EXPECT_EQ(std::count(names.begin(), names.end(), "expose"), 3) << "slices of 2048 entries";
  std::vector<void*> addresses;
  auto m = p.map(1, 3, &addresses);
  p.pump();
  ASSERT_TRUE(m->done && !m->error) << error_of(*m);
  ASSERT_TRUE(e->done && !e->error) << error_of(*e);
  ASSERT_EQ(addresses.size(), kCount);
  for (std::size_t i = 0; i < kCount; ++i) ASSERT_EQ(addresses[i], a.bytes.data() + 8 * i) << i;
}

TEST(IpcProtocol, CancelledLoanIsWithdrawnAndAFailedMappingFailsBothSides) {
  LinkPair p;
  Block a(p, 0, 1024);
  auto withdrawn = p.expose(0, 4, {slice(a, 0, 64)});
  p.pump();
  p.link[0]->cancel(*withdrawn);
  p.pump();
  ASSERT_TRUE(withdrawn->done && withdrawn->error);
  EXPECT_EQ(withdrawn->error->first, Errc::cancelled);
  // A map waits for the next loan; a cancelled map is never matched.
  std::vector<void*> addresses;
  auto cancelled = p.map(1, 4, &addresses);
  p.link[1]->cancel(*cancelled);
  EXPECT_TRUE(cancelled->done && cancelled->error && cancelled->error->first == Errc::cancelled);
  p.memory[1].import_error = Error(Errc::transport, "no such handle");
  auto m = p.map(1, 4, &addresses);
  auto e = p.expose(0, 4, {slice(a, 64, 64)});
  p.pump();
  ASSERT_TRUE(m->done && m->error);
  EXPECT_EQ(m->error->first, Errc::transport);
  EXPECT_NE(error_of(*m).find("no such handle"), std::string::npos) << error_of(*m);
  ASSERT_TRUE(e->done && e->error);
  EXPECT_EQ(e->error->first, Errc::transport);
  EXPECT_NE(error_of(*e).find("could not map the lent memory: "), std::string::npos)
      << error_of(*e);
  EXPECT_NE(error_of(*e).find("no such handle"), std::string::npos) << error_of(*e);
  EXPECT_TRUE(addresses.empty()) << "nothing is mapped in part";
}

TEST(IpcProtocol, ADeclinedLoanMapsNothingAndFailsTheLenderWithCancelled) {
  LinkPair p;
  Block a(p, 0, 64);
  auto e = p.expose(0, 8, {slice(a, 0, 64)});
  auto m = p.map(1, 8, nullptr);
  p.pump();
  ASSERT_TRUE(m->done && !m->error) << error_of(*m);
  EXPECT_EQ(m->transferred, 0u);
  ASSERT_TRUE(e->done && e->error);
  EXPECT_EQ(e->error->first, Errc::cancelled);
  EXPECT_EQ(error_of(*e), "rank 1 declined the loan");
  EXPECT_EQ(p.memory[1].imports, 0) << "nothing mapped";
}

TEST(IpcProtocol, LostPeerFailsLoansAndMaps) {
  LinkPair p;
  Block a(p, 0, 64);
  std::vector<void*> addresses;
  auto e = p.expose(0, 5, {slice(a, 0, 64)});
  auto m = p.map(0, 6, &addresses);
  p.link[0]->lose("the connection was closed");
  for (auto* op : {&e, &m}) {
    ASSERT_TRUE((*op)->done && (*op)->error);
    EXPECT_EQ((*op)->error->first, Errc::peer_failure);
  }
  EXPECT_EQ(p.link[0]->pending(), 0u);
}

TEST(IpcProtocol, CopiesThatFinishInOrderArePolledUpToTheFirstStillRunning) {
  for (const bool in_order : {false, true}) {
    LinkPair p;
    p.memory[1].auto_complete = false;
    p.memory[1].in_order = in_order;
    Block in(p, 0, 100 * 16);
    const auto out = pattern(100 * 16, 5);
    for (int i = 0; i < 100; ++i) {
      p.recv(0, 3, static_cast<uint8_t*>(in.data()) + 16 * i, 16);
      p.send(1, 3, out.data() + 16 * i, 16);
    }
    p.pump();
    ASSERT_EQ(p.memory[1].copies.size(), 100u);
    p.memory[1].done_calls = 0;
    EXPECT_FALSE(p.link[1]->poll());
    EXPECT_EQ(p.memory[1].done_calls, in_order ? 1 : 100);
    for (int i = 0; i < 40; ++i) p.memory[1].complete_next();
    p.memory[1].done_calls = 0;
    EXPECT_TRUE(p.link[1]->poll());
    EXPECT_EQ(p.memory[1].done_calls, in_order ? 41 : 100);
    EXPECT_EQ(p.link[1]->pending(), 60u);
    for (int i = 0; i < 60; ++i) p.memory[1].complete_next();
    p.pump();
    EXPECT_EQ(p.link[1]->pending(), 0u);
    EXPECT_EQ(p.link[0]->pending(), 0u);
    EXPECT_EQ(in.bytes, out);
  }
}

TEST(IpcProtocol, AMessagePassingDescriptorsLeavesAfterWhatWasQueuedBeforeIt) {
  LinkPair p;
  p.memory[0].fds_per_export = 1;
  Block a(p, 0, 64, 1), b(p, 0, 64, 2);
  auto ra = p.recv(0, 1, a.data(), 64);
  auto rb = p.recv(0, 1, b.data(), 64);
  p.link[0]->flush();
  // The receive into `a` went out before b's region, and only after a's.
  EXPECT_EQ(message_names(p.wire[0]),
            (std::vector<std::string>{"region", "recv_posted", "region", "recv_posted"}));
  ASSERT_EQ(p.wire[0].size(), 4u);
  EXPECT_EQ(p.wire[0][0].fds.size(), 1u);
  EXPECT_EQ(p.wire[0][2].fds.size(), 1u);
  const auto out = pattern(128, 2);
  p.send(1, 1, out.data(), 64);
  p.send(1, 1, out.data() + 64, 64);
  p.pump();
  ASSERT_TRUE(ra->done && rb->done && !ra->error && !rb->error);
  EXPECT_EQ(a.bytes, std::vector<uint8_t>(out.begin(), out.begin() + 64));
  EXPECT_EQ(b.bytes, std::vector<uint8_t>(out.begin() + 64, out.end()));
  // A batch that passes descriptors breaks the protocol.
  ipc::InPacket bad{ipc::encode_batch({ipc::encode(ipc::Cancel{1}), ipc::encode(ipc::Cancel{2})}),
                    {}};
  bad.fds.emplace_back(::dup(0));
  try {
    p.link[1]->on_packet(std::move(bad));
    FAIL() << "a batch with descriptors was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::protocol);
    EXPECT_NE(std::string(e.what()).find("descriptors with a batch"), std::string::npos)
        << e.what();
  }
}

TEST(IpcProtocol, PacketsThatBreakTheProtocolAreRefused) {
  LinkPair p;
  auto deliver = [&](const ipc::Message& m) {
    p.link[0]->on_packet(ipc::InPacket{ipc::encode(m), {}});
  };
  EXPECT_THROW(deliver(ipc::Complete{42, ipc::CompleteStatus::ok, 1, {}}), Error);
  EXPECT_THROW(deliver(ipc::RecvPosted{1, 1, 9, 0, 64}), Error);  // region 9 never announced
  Block in(p, 0, 64);
  auto r = p.recv(0, 1, in.data(), 64);
  try {
    deliver(ipc::Complete{r->recv_id, ipc::CompleteStatus::ok, 65, {}});
    FAIL() << "a completion larger than the receive was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::protocol);
    EXPECT_NE(std::string(e.what()).find("65 bytes"), std::string::npos) << e.what();
  }
  // Loans: a region never announced, more entries than announced, an id in
  // use, a tag changed between the messages of one loan.
  auto refused = [&](const ipc::Message& m, const std::string& part) {
    try {
      deliver(m);
      ADD_FAILURE() << "accepted (expected '" << part << "')";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::protocol) << e.what();
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  refused(ipc::Expose{50, 1, 1, {{9, 0, 64}}}, "region 9, which it never announced");
  deliver(ipc::Expose{51, 1, 3, {{0, 0, 0}, {0, 0, 0}}});
  refused(ipc::Expose{51, 2, 3, {{0, 0, 0}}}, "changed the tag or size");
  refused(ipc::Expose{51, 1, 3, {{0, 0, 0}, {0, 0, 0}}}, "more than the 3 buffers");
  deliver(ipc::Expose{52, 1, 0, {}});
  refused(ipc::Expose{52, 1, 0, {}}, "which is in use");
}

}  // namespace
}  // namespace weightsync::transport_test
