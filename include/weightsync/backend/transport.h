// Transport: moves byte buffers between the ranks of one world, point to point
// with 64-bit tags, plus an optional broadcast. Backends: "ucx" (host memory
// everywhere, CUDA memory where UCX was built with CUDA), "nccl" (CUDA memory),
// "cuda_ipc" (CUDA memory between the processes of one node, which it also
// lends), "ipc_host" (cuda_ipc over shared host memory, built everywhere), and
// wrappers such as "fault:<inner>" (fault injection for tests).
//
// Contract (every backend; the conformance suite in tests/transport checks it):
// - Created by name through a registry: make_transport(options). Each rank of a
//   world creates its transport with the same `name`, `store` and `prefix`,
//   its own `rank` and the common `world`. Ranks exchange their addresses
//   through the Store under `prefix` (UCX worker addresses; NCCL's unique id,
//   set by rank 0; cuda_ipc's and ipc_host's socket addresses). The first
//   operation with a peer may wait up to `bootstrap_timeout` for the peer's
//   address; connect() does it eagerly.
// - send() and recv() are non-blocking: they post the operation and return a
//   Request. The buffer must stay valid and untouched until the request is
//   complete (test() true or wait() returned) or its destructor ran. The
//   posting calls are [[nodiscard]]: a Request dropped at once cancels its
//   operation.
// - Ordering: messages from one sender to one receiver with the same tag are
//   matched in posting order. Messages with different tags are independent.
// - A receive accepts a message of at most its buffer's size; a larger message
//   fails the receive with Errc::mismatch naming peer, tag and both sizes. A
//   smaller one completes; Request::transferred() says how many bytes came.
// - Failures surface as weightsync::Error from test()/wait() (or from send/recv
//   for errors found at posting time): Errc::timeout from wait() naming the
//   peer, tag and bytes; Errc::peer_failure naming the peer rank when the peer
//   died or became unreachable (every pending operation with it fails);
//   Errc::transport carrying the library's own status string; Errc::unsupported
//   when a capability is missing (e.g. host memory on NCCL, or no GPU).
// - Thread-safety: a Transport and its Requests are used from one thread at a
//   time (the caller's thread drives progress: test(), wait(), progress()).
//   Different Transport objects are independent.
// - Lifetime: Requests and MemoryRegions must be destroyed before their
//   Transport. Destroying an incomplete Request cancels it and waits (bounded)
//   for the library to release the buffer.
#pragma once

#include <weightsync/store.h>
#include <weightsync/tensor.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace weightsync {

using Tag = uint64_t;

struct TransportOptions {
  // Registry name: "ucx", "nccl", "cuda_ipc", "ipc_host", or "<wrapper>:<inner>"
  // such as "fault:ucx".
  // Options may follow the name after '?' as k=v pairs joined by '&'
  // ("fault:ucx?corrupt_recv=1&count=1"); they are merged into `params`.
  std::string name = "ucx";
  Store* store = nullptr;  // not owned; used during creation and first contacts
  std::string prefix = "weightsync/transport";  // key prefix in the store, one per world
  int rank = 0;
  int world = 1;
  int device = -1;  // CUDA ordinal for GPU backends (-1: current device)
  std::chrono::milliseconds bootstrap_timeout{30000};
  // Backend- and wrapper-specific settings (see each backend's section below).
  std::map<std::string, std::string> params;
  // Incarnations: this process's (its coordinator member id; 0: unknown),
  // and that of the process holding rank `peer` now (0: none registered
  // yet). A backend that publishes addresses in the store tags its own with
  // its incarnation and connects to a peer only at the address of the
  // process that holds the peer's rank now, never at a departed one's,
  // which may still be in the store while a new process takes the rank over
  // (ucx). Unset: any published address is taken.
  uint64_t incarnation = 0;
  std::function<uint64_t(int peer)> incarnation_of;
};

struct Capabilities {
  bool host_memory = false;       // buffers in host memory may be sent/received
  bool cuda_memory = false;       // buffers in CUDA device memory may be sent/received
  bool native_broadcast = false;  // broadcast() is a collective of the library, not p2p fan-out
  std::size_t max_message_bytes = 0;
  int tag_bits = 64;  // tags must be < 2^tag_bits (UCX reserves high bits for the sender rank)
  // Messages with a peer match in posting order whatever their tags, and run
  // in order on one stream (NCCL): pipelines keep two buckets in flight.
  bool ordered_only = false;
  // expose() and map_exposed() work: a receiver lends registered memory to a
  // sender, whose own copies (one kernel writing many tensors) then write
  // into it with no message per buffer (cuda_ipc, ipc_host). A wrapper may
  // answer loans without making them: "fault:" lends nothing (its expose
  // completes having lent 0 bytes) and declines what it is lent, so that
  // its rank's peers still get their answer.
  bool maps_peer_memory = false;
  // The library that moves the bytes, as this process loaded it, e.g.
  // "UCX 1.22.0 (/path/libucp.so.0)"; empty where there is none to name.
  std::string library;
};

class MemoryRegion;

// A contiguous buffer to send from or receive into. `region`, when set, is a
// registered region containing [data, data + bytes): the backend may then
// skip per-message registration (UCX passes its ucp_mem_h).
struct Buffer {
  void* data = nullptr;
  std::size_t bytes = 0;
  MemoryKind memory = MemoryKind::host;
  int device = -1;
  const MemoryRegion* region = nullptr;
};

inline Buffer host_buffer(const void* data, std::size_t bytes,
                          const MemoryRegion* region = nullptr) {
  return Buffer{const_cast<void*>(data), bytes, MemoryKind::host, -1, region};
}

// Memory registered with a transport (ucp_mem_map for UCX; a no-op for NCCL;
// cuda_ipc and ipc_host refuse memory they cannot share with their peers).
// Deregistered by the destructor.
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  MemoryKind memory() const { return memory_; }
  int device() const { return device_; }
  bool contains(const Buffer& b) const;

 protected:
  MemoryRegion(void* data, std::size_t bytes, MemoryKind memory, int device)
      : data_(data), bytes_(bytes), memory_(memory), device_(device) {}

 private:
  void* data_;
  std::size_t bytes_;
  MemoryKind memory_;
  int device_;
};

// A posted operation. test() and wait() drive the transport's progress.
class Request {
 public:
  enum class Kind { send, recv, broadcast, expose, map };
  virtual ~Request() = default;

  // True once the operation completed; throws its Error if it failed (again on
  // every later call).
  virtual bool test() = 0;
  // Drives progress until complete; returns transferred(). Errc::timeout after
  // `timeout`, naming the transport, peer, tag and bytes; the request stays
  // posted (wait again, or cancel()).
  virtual std::size_t wait(std::chrono::milliseconds timeout);
  // Asks the library to abandon the operation; it then completes with
  // Errc::cancelled (unless it had already finished). A send that may be
  // partly on the wire cannot be withdrawn: cancelling it gives up the peer
  // (UCX closes the connection; NCCL aborts the communicator).
  virtual void cancel() = 0;
  // Bytes moved: the posted size for a send, the arrived size for a receive.
  virtual std::size_t transferred() const = 0;

  Kind kind() const { return kind_; }
  int peer() const { return peer_; }  // the root for a broadcast
  Tag tag() const { return tag_; }
  std::size_t bytes() const { return bytes_; }  // as posted
  // "receive from rank 3, tag 0x2a, 1048576 bytes, over ucx" (for messages).
  std::string describe() const;

 protected:
  Request(std::string transport, Kind kind, int peer, Tag tag, std::size_t bytes)
      : transport_(std::move(transport)), kind_(kind), peer_(peer), tag_(tag), bytes_(bytes) {}

 private:
  std::string transport_;
  Kind kind_;
  int peer_;
  Tag tag_;
  std::size_t bytes_;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string name() const = 0;  // e.g. "ucx", "fault:ucx"
  virtual int rank() const = 0;
  virtual int world() const = 0;
  virtual Capabilities capabilities() const = 0;

  // Registers memory for repeated use as (part of) a Buffer's region.
  virtual std::unique_ptr<MemoryRegion> register_memory(const Buffer& buffer) = 0;
  // Posts a send of `buffer` to `peer` (non-blocking).
  [[nodiscard]] virtual std::unique_ptr<Request> send(int peer, Tag tag, const Buffer& buffer) = 0;
  // Posts a receive into `buffer` of a message from `peer` with `tag`.
  [[nodiscard]] virtual std::unique_ptr<Request> recv(int peer, Tag tag, const Buffer& buffer) = 0;
  // Advances every outstanding operation without blocking.
  virtual void progress() = 0;
  // Eagerly connects to `peer` (waits for its address up to bootstrap_timeout).
  virtual void connect(int peer) = 0;
  // True once the transport learned that `peer` died or became unreachable.
  virtual bool peer_failed(int peer) const = 0;
  // A new process took rank `peer` (it created its transport with the same
  // prefix): drop the old connection (its pending operations fail with
  // Errc::peer_failure) and connect afresh on the next operation, to the
  // address the new process publishes (waited for up to bootstrap_timeout).
  // Errc::unsupported where the backend cannot (NCCL: a communicator is fixed).
  virtual void reconnect(int peer);
  // The caller learned that every message sent so far has arrived or is no
  // longer wanted (a trainer, once its step is decided): closing need not
  // flush them. A graceful UCX close waits for its peer to progress, which an
  // engine between steps does not: without this, a trainer's close waited
  // 10 s for each idle engine. The default does nothing.
  virtual void sends_settled() {}
  // Host memory for the data path's own buffers (staging slots, staging
  // copies of params): `bytes` zeroed and page-aligned, freed when the last
  // owner lets go. Where the transport moves host memory by mapping it into
  // its peers ("ipc_host"), memory they can map, so that those buffers can
  // be received into and lent; elsewhere (the default) the heap's.
  virtual std::shared_ptr<char> allocate_host(std::size_t bytes);

  // Broadcast of `buffer` from `root` to every rank of `ranks` (which includes
  // root); called by each of those ranks with the same arguments and a buffer
  // of the same size. The default fans out point to point with `tag`;
  // backends with capabilities().native_broadcast override it.
  [[nodiscard]] virtual std::unique_ptr<Request> broadcast(const Buffer& buffer, int root,
                                                           const std::vector<int>& ranks, Tag tag);

  // ---- memory lent to a peer (capabilities().maps_peer_memory) ------------
  // Receiver: lends `buffers` to `peer`, which maps them with map_exposed()
  // under the same `tag` (per tag, exposes and maps match in posting order).
  // Completes once the peer mapped every one (transferred(): their bytes in
  // all); fails with the peer's reason when it could not. The memory stays
  // lent until its registration ends (or, unregistered, until the backend
  // finds it freed): the caller keeps it registered for as long as the peer
  // may write, and learns from the peer by a message when its writes are
  // done. Errc::unsupported where the backend cannot (the default).
  [[nodiscard]] virtual std::unique_ptr<Request> expose(int peer, Tag tag,
                                                        const std::vector<Buffer>& buffers);
  // Sender: maps what `peer` lends under `tag`. Once complete, `*addresses`
  // holds one address per lent buffer, in order (nullptr for an empty one),
  // that this process's copies for the transport's memory kind may write
  // (device pointers for CUDA memory), valid until the peer ends the
  // registration. `addresses` must outlive the request. With `addresses`
  // null the loan is declined: nothing is mapped, and the peer's expose
  // fails with Errc::cancelled. Errc::unsupported where the backend cannot
  // (the default).
  [[nodiscard]] virtual std::unique_ptr<Request> map_exposed(int peer, Tag tag,
                                                             std::vector<void*>* addresses);
};

// The registry. A factory receives the options with `name` as requested; a
// wrapper registered as "fault" is found for "fault:ucx" and creates its inner
// transport with make_transport() on the rest of the name.
using TransportFactory = std::function<std::unique_ptr<Transport>(const TransportOptions&)>;
void register_transport(const std::string& name, TransportFactory factory);
std::vector<std::string> transport_names();
// Host memory for tensors that will be received into or lent over transport
// `name` (wrappers and ?params allowed, e.g. "fault:ipc_host?seed=1"):
// `bytes` zeroed and page-aligned, freed when the last owner lets go. Memory
// its peers can map where the transport needs that ("ipc_host": its shared
// arena, as "cuda_ipc" needs cudaMalloc memory); the heap's for every other.
using HostAllocator = std::function<std::shared_ptr<char>(std::size_t bytes)>;
std::shared_ptr<char> allocate_host_memory(const std::string& name, std::size_t bytes);
// Registers the allocator allocate_host_memory() uses for transport `name`.
void register_host_allocator(const std::string& name, HostAllocator allocate);
// Errc::invalid_argument for an unknown name (listing the known ones);
// Errc::unsupported when the backend cannot run here (e.g. NCCL without GPU).
std::unique_ptr<Transport> make_transport(TransportOptions options);

// ---- backend settings (TransportOptions::params) ----------------------------
//
// A built-in backend refuses a key it does not read, and the fault wrapper one
// that is neither its own nor its inner transport's (Errc::invalid_argument,
// naming the key and the accepted ones); a backend added with
// register_transport reads its params itself.
//
// ucx: tags < 2^48 (the sender rank rides in the high 16 bits; world <= 65536).
//   The UCX transports used follow UCX_TLS from the environment, or
//   params["tls"] (e.g. "tcp,self" or "posix,sysv,cma,self") when given.
//   Other UCX settings: params["UCX_<NAME>"] (e.g. UCX_RNDV_THRESH=64k).
//   Settings go to this transport's own UCX context (ucp_config_modify),
//   never to the process environment. Where tcp may be used, weightsync
//   tunes it: UCX_TCP_PUT_ENABLE=n, UCX_TCP_RX_SEG_SIZE=256K,
//   UCX_TCP_MAX_POLL=64, and UCX_KEEPALIVE_INTERVAL=1s everywhere. A value
//   the user gives for one of these, as a param or as that UCX_* variable in
//   the environment (which UCX reads itself), stands instead; weightsync
//   reads the environment only for UCX_TLS and these names, to know that.
//   Dead peers are reported (Errc::peer_failure) where the UCX transports can
//   tell (tcp); UCX 1.13's shared-memory transports cannot, and asking for it
//   excludes them, so with only shared memory in "tls" the transport does not
//   ask and a dead peer shows as Errc::timeout. params["peer_errors"] = "on" |
//   "off" | "auto" (default) overrides. Note: with UCX_TLS unset (all), peer
//   error reporting makes UCX use tcp even between processes of one host.
//   CUDA memory: buffers in GPU memory are registered and sent as CUDA
//   memory, with no host copy, when the UCX loaded was built with CUDA and
//   finds a GPU (Debian's 1.13 was not; PyPI's libucx-cu13 was: see
//   docs/transports.md for how it is picked). params["cuda"] = "auto"
//   (default: when UCX can) | "require" (creation fails with
//   Errc::unsupported, naming the UCX library and why, when it cannot) |
//   "off" (never; GPU tensors then go through pinned host slots).
// nccl: CUDA memory only; tags are not matched by NCCL, so both sides must post
//   operations with a peer in the same order. On a wait timeout the
//   communicator is aborted (ncclCommAbort) and the transport is unusable.
// cuda_ipc: the processes of one node (a peer on another machine is refused),
//   over Unix-domain sockets in the abstract namespace, or in
//   params["socket_dir"] when given (for ranks in different network
//   namespaces). CUDA memory from cudaMalloc (or VMM) only.
// ipc_host: cuda_ipc over host memory from each process's shared arena
//   (allocate_host); params["socket_dir"] as for cuda_ipc, and
//   params["local"] = "1" also accepts memory outside the arena within the
//   process (a Publisher and Subscribers as threads of one process).
// fault:<inner> (deterministic: the same seed and the same sequence of calls
//   inject the same faults; over a transport that lends memory it answers
//   loans but lends nothing and declines what it is lent, so that every
//   bucket goes through its faults: Capabilities::maps_peer_memory).
//   Each fault applies to an operation chosen with
//   probability P from a generator seeded with `seed`, among operations whose
//   index (per kind: sends or receives, counted from 0) is >= `after`, whose
//   tag is one of `tag` when given, at most `count` times in total when given:
//     seed=N           generator seed (default 1)
//     drop_send=P      the send completes locally but nothing is sent
//     corrupt_send=P   a copy of the payload with one byte flipped is sent
//     truncate_send=P  the payload goes out one byte short
//     corrupt_recv=P   one byte of the received buffer is flipped
//     delay_ms=D       every operation completes no sooner than D ms after posting
//     fail_after=N     operations after the first N (sends+receives) fail with
//                      Errc::transport "injected failure"
//     dead=R1,R2       every operation to/from these ranks fails with
//                      Errc::peer_failure
//     after=N, tag=T[,T2...], count=K  as described above (tag: a list)
//     freeze_send=N    posting its N-th send (counted from 1) the rank stops
//     freeze_recv=N    (SIGSTOP), as a hung process would, after a line on
//                      stderr; SIGCONT resumes it. Test hooks, refused with
//                      Errc::invalid_argument unless the process armed them
//                      (tests; the failure drills of `weightsync demo --kill`
//                      and of the export's tests arm their victim, freeze it
//                      and SIGKILL it from outside).
//     release_ms=D     a send completes only once its receiver released it:
//                      the receiver sends an 8-byte release back (the tag
//                      with bit 47 set) D ms after the receive completed,
//                      and only from its progress() or a request's test(),
//                      as UCX's rendezvous needs the receiver's worker
//                      progressed to release a sender. A rank that stops
//                      progressing holds its senders. Every rank sets it.
//   With no fault set the wrapper passes everything through unchanged.

}  // namespace weightsync
