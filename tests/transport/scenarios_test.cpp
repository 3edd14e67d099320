// The conformance scenarios: every rank runs the same function (see harness.h).
// Rank 0 is the test process; the others are spawned peers.
#include "harness.h"
#include "transport/staging.h"

#include <cstdlib>
#include <filesystem>
#include <map>
#include <thread>

namespace weightsync::transport_test {
namespace {

constexpr Tag kByeTag = 0xB1E;
constexpr auto kWait = std::chrono::milliseconds(120000);

using Requests = std::vector<std::unique_ptr<Request>>;
using Buffers = std::vector<std::unique_ptr<TestBuffer>>;

std::unique_ptr<TestBuffer> filled(std::size_t bytes, MemoryKind memory, uint64_t seed,
                                   std::size_t offset = 0) {
  auto b = std::make_unique<TestBuffer>(bytes, memory, offset);
  b->fill(seed);
  return b;
}

std::unique_ptr<TestBuffer> zeroed(std::size_t bytes, MemoryKind memory, std::size_t offset = 0) {
  auto b = std::make_unique<TestBuffer>(bytes, memory, offset);
  b->zero();
  return b;
}

void require_holds(const TestBuffer& b, std::size_t transferred, std::size_t expected,
                   uint64_t seed, const std::string& what) {
  require(transferred == expected,
          cat(what, ": ", transferred, " bytes arrived, expected ", expected));
  require(b.holds(seed, expected), cat(what, ": ", b.differing(seed, expected), " of ", expected,
                                       " bytes differ from what was sent"));
}

// Keeps the peers alive until rank 0 is done with them: rank 0 sends a byte
// to every other rank, which waits for it before exiting.
void bye(ScenarioContext& c) {
  Transport& t = c.transport;
  TestBuffer b(1, c.memory);
  b.zero();
  if (t.rank() == 0) {
    Requests sends;
    for (int r = 1; r < t.world(); ++r) sends.push_back(t.send(r, kByeTag, b.buffer()));
    wait_all(sends, kWait);
  } else {
    t.recv(0, kByeTag, b.buffer())->wait(kWait);
  }
}

// Rank 1 sends interleaved streams on two tags; rank 0 receives all of tag 8
// before any of tag 7: each tag's messages arrive in posting order.
void ordering(ScenarioContext& c) {
  Transport& t = c.transport;
  constexpr int kCount = 200;
  auto size_of = [](int i) { return std::size_t(8 + (i % 5) * 1000); };
  Buffers buffers;
  Requests requests;
  if (t.rank() == 1) {
    for (int i = 0; i < kCount; ++i) {
      buffers.push_back(filled(size_of(i), c.memory, i));
      requests.push_back(t.send(0, 7, buffers.back()->buffer()));
      buffers.push_back(filled(size_of(i), c.memory, 1000 + i));
      requests.push_back(t.send(0, 8, buffers.back()->buffer()));
    }
    wait_all(requests, kWait);
  } else {
    for (Tag tag : {Tag{8}, Tag{7}})
      for (int i = 0; i < kCount; ++i) {
        buffers.push_back(zeroed(size_of(kCount - 1) + 5000, c.memory));
        requests.push_back(t.recv(1, tag, buffers.back()->buffer()));
      }
    wait_all(requests, kWait);
    for (int k = 0; k < 2 * kCount; ++k) {
      const int i = k % kCount;
      const uint64_t seed = k < kCount ? 1000 + i : i;
      require_holds(*buffers[k], requests[k]->transferred(), size_of(i), seed,
                    cat("message ", i, " of tag ", k < kCount ? 8 : 7));
    }
  }
  bye(c);
}

// 64 messages of about 1 MiB in flight in each direction at once.
void in_flight(ScenarioContext& c) {
  Transport& t = c.transport;
  const int peer = 1 - t.rank();
  constexpr int kCount = 64;
  Buffers in, out;
  Requests recvs, sends;
  for (int i = 0; i < kCount; ++i) {
    in.push_back(zeroed((1 << 20) + i, c.memory));
    recvs.push_back(t.recv(peer, 100 + i, in.back()->buffer()));
  }
  for (int i = 0; i < kCount; ++i) {
    out.push_back(filled((1 << 20) + i, c.memory, t.rank() * 1000 + i));
    sends.push_back(t.send(peer, 100 + i, out.back()->buffer()));
  }
  wait_all(recvs, kWait);
  wait_all(sends, kWait);
  for (int i = 0; i < kCount; ++i)
    require_holds(*in[i], recvs[i]->transferred(), (1 << 20) + i, peer * 1000 + i,
                  cat("in-flight message ", i));
  bye(c);
}

// Both directions at once, for every size from 0 bytes to 128 MiB.
void exchange(ScenarioContext& c, std::size_t bytes, Tag tag, std::size_t offset = 0) {
  Transport& t = c.transport;
  const int peer = 1 - t.rank();
  auto in = zeroed(bytes, c.memory, (8 - offset) % 8);
  auto out = filled(bytes, c.memory, bytes * 31 + t.rank(), offset);
  auto r = t.recv(peer, tag, in->buffer());
  auto s = t.send(peer, tag, out->buffer());
  const std::size_t got = r->wait(kWait);
  s->wait(kWait);
  require_holds(*in, got, bytes, bytes * 31 + peer, cat(bytes, "-byte message at offset ", offset));
}

void sizes(ScenarioContext& c) {
  const std::size_t list[] = {0, 1, 7, 8, 4095, 65537, (1u << 20) + 3, (16u << 20) + 1, 128u << 20};
  Tag tag = 200;
  for (std::size_t bytes : list) exchange(c, bytes, tag++);
  bye(c);
}

void one_gib(ScenarioContext& c) {
  Transport& t = c.transport;
  constexpr std::size_t kBytes = std::size_t{1} << 30;
  if (t.rank() == 1) {
    auto out = filled(kBytes, c.memory, 5);
    t.send(0, 300, out->buffer())->wait(kWait);
  } else {
    auto in = zeroed(kBytes, c.memory);
    const std::size_t got = t.recv(1, 300, in->buffer())->wait(kWait);
    require_holds(*in, got, kBytes, 5, "1 GiB message");
  }
  bye(c);
}

// Buffers that start 1..7 bytes past an aligned address, eager and rendezvous.
void unaligned(ScenarioContext& c) {
  Tag tag = 400;
  for (std::size_t offset = 1; offset <= 7; ++offset) {
    exchange(c, 100 + offset, tag++, offset);
    exchange(c, (1 << 20) + 3 * offset, tag++, offset);
  }
  bye(c);
}

// A receive nobody matches times out, naming peer, tag and size; the pair
// keeps working afterwards.
void recv_timeout(ScenarioContext& c) {
  Transport& t = c.transport;
  TestBuffer b(64, c.memory);
  if (t.rank() == 0) {
    auto r = t.recv(1, 900, b.buffer());
    require_error([&] { r->wait(std::chrono::milliseconds(200)); }, Errc::timeout,
                  {"rank 1", "0x384", "64 bytes", "200 ms"});
    r->cancel();
    require_error([&] { r->wait(kWait); }, Errc::cancelled, {"rank 1"});
  }
  exchange(c, 4096, 901);
  bye(c);
}

// Rank 1 streams 64 MiB messages until rank 0 kills it mid-stream; rank 0's
// receive then fails with peer_failure or timeout within a bounded wait.
void peer_death(ScenarioContext& c) {
  Transport& t = c.transport;
  constexpr std::size_t kBytes = 64u << 20;
  if (t.rank() == 1) {
    auto out = filled(kBytes, c.memory, 9);
    for (;;) t.send(0, 1000, out->buffer())->wait(kWait);
  }
  auto in = zeroed(kBytes, c.memory);
  require(t.recv(1, 1000, in->buffer())->wait(kWait) == kBytes, "first message complete");
  auto r = t.recv(1, 1000, in->buffer());
  c.kill_peer(1);
  // Messages already buffered may still land; a dead peer cannot send more
  // than a few of them.
  for (int attempt = 0; attempt < 8; ++attempt) {
    try {
      r->wait(std::chrono::milliseconds(10000));
    } catch (const Error& e) {
      require(e.code() == Errc::peer_failure || e.code() == Errc::timeout,
              cat("expected peer_failure or timeout, got ", errc_name(e.code()), ": ", e.what()));
      if (e.code() == Errc::peer_failure) {
        require(std::string(e.what()).find("rank 1") != std::string::npos, "names rank 1");
        require(t.peer_failed(1), "peer_failed(1) after a peer_failure");
        TestBuffer one(1, c.memory);
        require_error([&] { t.send(1, 1, one.buffer())->wait(kWait); }, Errc::peer_failure,
                      {"rank 1"});
      }
      return;
    }
    r = t.recv(1, 1000, in->buffer());
  }
  require(false, "receives from a killed peer kept succeeding");
}

// A message larger than the receive buffer fails the receive (eager and
// rendezvous sizes) and leaves the pair usable.
void truncation(ScenarioContext& c) {
  Transport& t = c.transport;
  if (t.rank() == 1) {
    auto small = filled(1000, c.memory, 1);
    auto large = filled((1 << 20) + 1, c.memory, 2);
    auto s1 = t.send(0, 1100, small->buffer());
    auto s2 = t.send(0, 1101, large->buffer());
    // The sender's side of a truncated message may complete or fail.
    for (auto* s : {&s1, &s2}) try {
        (*s)->wait(kWait);
      } catch (const Error&) {
      }
  } else {
    TestBuffer b1(100, c.memory), b2(64 << 10, c.memory);
    require_error([&] { t.recv(1, 1100, b1.buffer())->wait(kWait); }, Errc::mismatch,
                  {"rank 1", "100-byte"});
    require_error([&] { t.recv(1, 1101, b2.buffer())->wait(kWait); }, Errc::mismatch,
                  {"rank 1", "65536-byte"});
  }
  exchange(c, 8192, 1102);
  bye(c);
}

// World of 3: a broadcast over every rank, then one over a subset.
void broadcast(ScenarioContext& c) {
  Transport& t = c.transport;
  constexpr std::size_t kBytes = 8u << 20;
  auto b = t.rank() == 0 ? filled(kBytes, c.memory, 77) : zeroed(kBytes, c.memory);
  t.broadcast(b->buffer(), 0, {0, 1, 2}, 1200)->wait(kWait);
  require_holds(*b, kBytes, kBytes, 77, "broadcast from rank 0");
  if (t.rank() != 0) {
    auto b2 =
        t.rank() == 2 ? filled((1 << 20) + 3, c.memory, 78, 3) : zeroed((1 << 20) + 3, c.memory, 5);
    t.broadcast(b2->buffer(), 2, {1, 2}, 1201)->wait(kWait);
    require_holds(*b2, b2->size(), b2->size(), 78, "broadcast from rank 2 to {1, 2}");
  }
  bye(c);
}

}  // namespace

// Defined in fault_test.cpp.
void fault_corrupt_recv(ScenarioContext& c);
void fault_corrupt_send(ScenarioContext& c);
void fault_drop_send(ScenarioContext& c);
void fault_truncate_send(ScenarioContext& c);
// Defined in ipc_scenarios_test.cpp: cuda_ipc's own scenarios, or nullptr.
Scenario find_ipc_scenario(const std::string& name);
// Defined in lend_sync_test.cpp: the lending sync's engine process, or nullptr.
Scenario find_lend_scenario(const std::string& name);

// Rank 1 of Conformance.ClosingAfterSettledSendsDoesNotWaitForAnIdlePeer
// (rank 0 is the test itself): receives a small and a large message from
// rank 0, answers, then leaves its transport alone (no progress) until rank
// 0 has closed its own (the file `closed` in the store's directory).
void idle_after_answer(ScenarioContext& c) {
  Transport& t = c.transport;
  require(t.rank() == 1, "idle_after_answer runs as rank 1 only");
  constexpr std::size_t kLarge = 8 << 20;  // past UCX's eager limit: rendezvous
  auto small = zeroed(64, c.memory);
  auto large = zeroed(kLarge, c.memory);
  auto got_small = t.recv(0, 1, small->buffer());
  auto got_large = t.recv(0, 2, large->buffer());
  require_holds(*small, got_small->wait(kWait), 64, 1, "the small message");
  require_holds(*large, got_large->wait(kWait), kLarge, 2, "the large message");
  auto answer = filled(1, c.memory, 3);
  t.send(0, 3, answer->buffer())->wait(kWait);
  const char* store = std::getenv("WS_TP_STORE");
  require(store != nullptr, "no WS_TP_STORE");
  const auto closed = std::filesystem::path(store) / "closed";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!std::filesystem::exists(closed)) {
    require(std::chrono::steady_clock::now() < deadline, "rank 0 did not close within 60 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

Scenario find_scenario(const std::string& name) {
  static const std::map<std::string, Scenario> scenarios{
      {"ordering", ordering},
      {"in_flight", in_flight},
      {"sizes", sizes},
      {"one_gib", one_gib},
      {"unaligned", unaligned},
      {"recv_timeout", recv_timeout},
      {"peer_death", peer_death},
      {"truncation", truncation},
      {"broadcast", broadcast},
      {"idle_after_answer", idle_after_answer},
      {"fault_corrupt_recv", fault_corrupt_recv},
      {"fault_corrupt_send", fault_corrupt_send},
      {"fault_drop_send", fault_drop_send},
      {"fault_truncate_send", fault_truncate_send},
  };
  auto it = scenarios.find(name);
  if (it != scenarios.end()) return it->second;
  if (Scenario s = find_ipc_scenario(name)) return s;
  if (Scenario s = find_lend_scenario(name)) return s;
  fail(Errc::not_found, "no transport test scenario '", name, "'");
}

}  // namespace weightsync::transport_test
