// The wire format of p2p buckets (wire.h): how buckets are cut into
// fragments, which boxes are dense runs, and the publisher and subscriber
// moving fragments zero-copy or packed, with and without checksums, through
// their C++ API over UCX (bit-exact against the checkpoint).
#include "e2e/e2e_helpers.h"

#include <nlohmann/json.hpp>

#include <weightsync/backend/transport.h>
#include <weightsync/control.h>
#include <weightsync/layouts.h>
#include <weightsync/materialize.h>
#include <weightsync/publisher.h>
#include <weightsync/subscriber.h>
#include "pipeline/delta_frame.h"
#include "pipeline/item_copies.h"
#include "pipeline/wire.h"
#include "transport/staging.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <thread>

namespace weightsync::e2e {
namespace {

Box box(Shape offsets, Shape lengths) {
  return Box{std::move(offsets), std::move(lengths)};
}

TEST(Wire, DenseRunOffset) {
  const Shape s = contiguous_strides({4, 6});  // {6, 1}
  EXPECT_EQ(dense_run_offset(s, box({0, 0}, {4, 6})), 0);
  EXPECT_EQ(dense_run_offset(s, box({1, 0}, {2, 6})), 6) << "whole rows";
  EXPECT_EQ(dense_run_offset(s, box({2, 1}, {1, 4})), 13) << "part of one row";
  EXPECT_EQ(dense_run_offset(s, box({0, 0}, {2, 3})), std::nullopt) << "half rows";
  EXPECT_EQ(dense_run_offset(s, box({3, 5}, {1, 1})), 23);
  // Leading length-1 dims (expert params) and a transposed view.
  EXPECT_EQ(dense_run_offset(contiguous_strides({8, 4, 6}), box({5, 1, 0}, {1, 2, 6})), 5 * 24 + 6);
  EXPECT_EQ(dense_run_offset(Shape{1, 4}, box({0, 0}, {4, 6})), std::nullopt);
  EXPECT_EQ(dense_run_offset(Shape{1, 4}, box({0, 2}, {4, 1})), 8) << "one column of a transpose";
  EXPECT_EQ(dense_run_offset(Shape{6}, box({0, 0}, {1, 2})), std::nullopt) << "rank mismatch";
}

TEST(Wire, DirectRouteNeedsADenseRunTheTransportReaches) {
  std::vector<uint16_t> data(24);
  const TensorView host = host_view(data.data(), DType::BF16, {4, 6});
  Capabilities caps;
  caps.host_memory = true;
  WireOptions wire;
  EXPECT_EQ(direct_route(host, box({1, 0}, {2, 6}), caps, wire).direct,
            reinterpret_cast<char*>(data.data() + 6));
  EXPECT_EQ(direct_route(host, box({0, 0}, {2, 3}), caps, wire).direct, nullptr) << "not dense";
  caps.host_memory = false;
  EXPECT_EQ(direct_route(host, box({1, 0}, {2, 6}), caps, wire).direct, nullptr)
      << "host not reachable";
  // A CUDA view (never dereferenced): reachable unless checksums reach
  // device paths (checksums_gpu); the default checksums leave it.
  TensorView cuda = host;
  cuda.memory = MemoryKind::cuda;
  caps.cuda_memory = true;
  const FragmentRoute route = direct_route(cuda, box({1, 0}, {2, 6}), caps, wire);
  EXPECT_NE(route.direct, nullptr);
  EXPECT_EQ(route.memory, MemoryKind::cuda);
  ASSERT_TRUE(wire.checksums) << "on by default";
  wire.checksums_gpu = true;
  EXPECT_EQ(direct_route(cuda, box({1, 0}, {2, 6}), caps, wire).direct, nullptr);
  wire.checksums = false;  // checksums_gpu alone does nothing
  EXPECT_NE(direct_route(cuda, box({1, 0}, {2, 6}), caps, wire).direct, nullptr);
}

TEST(Wire, SlotsLiveWhereTheDataGoes) {
  Capabilities ucx, nccl, both;
  ucx.host_memory = true;
  nccl.cuda_memory = true;
  both.host_memory = both.cuda_memory = true;
  WireOptions plain, checked;
  plain.checksums = false;
  checked.checksums_gpu = true;
  const WireOptions defaults;  // checksums on, for host paths only
  auto slots = [](MemoryKind m, const Capabilities& c, const WireOptions& w) {
    return choose_slot_memory(m, c, w, "trainer rank 1", "x");
  };
  EXPECT_EQ(slots(MemoryKind::host, ucx, plain), SlotMemory::host);
  EXPECT_EQ(slots(MemoryKind::host, both, plain), SlotMemory::host);
  EXPECT_EQ(slots(MemoryKind::cuda, ucx, plain), SlotMemory::pinned) << "never pageable";
  EXPECT_EQ(slots(MemoryKind::cuda, nccl, plain), SlotMemory::device);
  EXPECT_EQ(slots(MemoryKind::cuda, both, plain), SlotMemory::device);
  EXPECT_EQ(slots(MemoryKind::cuda, both, checked), SlotMemory::pinned) << "host checksums";
  EXPECT_EQ(slots(MemoryKind::cuda, both, defaults), SlotMemory::device);
  EXPECT_EQ(slots(MemoryKind::cuda, nccl, defaults), SlotMemory::device);
  auto refused = [&](MemoryKind m, const Capabilities& c, const WireOptions& w,
                     const std::string& part) {
    try {
      choose_slot_memory(m, c, w, "trainer rank 1", "nccl");
      ADD_FAILURE() << "accepted: " << part;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::unsupported);
      const std::string what = e.what();
      EXPECT_NE(what.find("trainer rank 1"), std::string::npos) << what;
      EXPECT_NE(what.find("'nccl'"), std::string::npos) << what;
      EXPECT_NE(what.find(part), std::string::npos) << what;
    }
  };
  refused(MemoryKind::host, nccl, plain, "host memory");
  refused(MemoryKind::cuda, nccl, checked, "checksums_gpu");
  EXPECT_STREQ(slot_memory_name(SlotMemory::pinned), "pinned");
}

TEST(Wire, MoreSlotsWhenTheyAreSmallNextToTheBuckets) {
  constexpr int64_t kBucket = int64_t{256} << 20;
  const std::size_t whole = static_cast<std::size_t>(kBucket) + 8;
  const WireOptions wire;
  const Capabilities caps;  // matched by tag (ucx, cuda_ipc)
  auto depth = [&](std::size_t slot, int64_t bucket, std::size_t buckets) {
    return slot_depth(slot, bucket, buckets, false, wire, caps);
  };
  // Buckets packed whole: two slots, as ever.
  EXPECT_EQ(depth(whole, kBucket, 100), 2u);
  // Small slots (most bytes go direct): as many as two whole ones' memory.
  EXPECT_EQ(depth(std::size_t{16} << 20, kBucket, 100), 32u);
  EXPECT_EQ(depth(std::size_t{100} << 20, kBucket, 100), 5u);
  EXPECT_LE(depth(std::size_t{100} << 20, kBucket, 100) * (std::size_t{100} << 20),
            2 * static_cast<std::size_t>(kBucket));
  // Bounded by kMaxSlotDepth and by the buckets; never fewer than two.
  EXPECT_EQ(depth(8, kBucket, 1000), kMaxSlotDepth);
  EXPECT_EQ(depth(8, kBucket, 7), 7u);
  EXPECT_EQ(depth(0, kBucket, 20), 20u) << "nothing staged: every bucket in flight";
  EXPECT_EQ(depth(8, kBucket, 1), 2u);
  EXPECT_EQ(depth(8, 0, 10), 2u) << "empty buckets";
  // Broadcast buckets, delta sync and a transport that matches in posting
  // order on one stream (NCCL) keep two.
  EXPECT_EQ(slot_depth(8, kBucket, 100, true, wire, caps), 2u);
  WireOptions delta;
  delta.delta = true;
  EXPECT_EQ(slot_depth(8, kBucket, 100, false, delta, caps), 2u);
  Capabilities nccl;
  nccl.ordered_only = true;
  EXPECT_EQ(slot_depth(8, kBucket, 100, false, wire, nccl), 2u);
}

// add_pack_apply (a lent bucket's one copy, trainer tensor straight into the
// engine param) writes what add_pack into a slot and add_apply out of it
// write, and nothing else: sub-boxes of rows and of columns, strided
// sources, transposed params, leading length-1 dims on either side.
TEST(Wire, PackApplyInOneCopyWritesWhatPackThenApplyWrite) {
  struct Case {
    const char* what;
    Shape src_shape;
    Box src_box;
    Shape dst_shape;
    Box dst_box;
    Box hf_box;
    bool transpose = false;
    bool padded = false;  // the source seen through a padded view
  };
  const std::vector<Case> cases{
      {"rows", {8, 6}, box({2, 0}, {3, 6}), {5, 6}, box({1, 0}, {3, 6}), box({4, 0}, {3, 6})},
      {"columns", {4, 10}, box({0, 2}, {4, 5}), {4, 5}, box({0, 0}, {4, 5}), box({0, 0}, {4, 5})},
      {"transposed",
       {4, 6},
       box({0, 0}, {4, 6}),
       {8, 4},
       box({2, 0}, {6, 4}),
       box({0, 0}, {4, 6}),
       true},
      {"transposed from a strided source",
       {5, 7},
       box({1, 1}, {3, 5}),
       {5, 3},
       box({0, 0}, {5, 3}),
       box({0, 0}, {3, 5}),
       true,
       true},
      {"expert dim on the param",
       {5, 6},
       box({0, 0}, {5, 6}),
       {3, 5, 6},
       box({1, 0, 0}, {1, 5, 6}),
       box({0, 0}, {5, 6})},
      {"leading one on the source",
       {1, 5, 6},
       box({0, 0, 0}, {1, 5, 6}),
       {5, 6},
       box({0, 0}, {5, 6}),
       box({0, 0}, {5, 6})},
      {"leading one the source lacks",
       {5, 6},
       box({0, 0}, {5, 6}),
       {2, 5, 6},
       box({1, 0, 0}, {1, 5, 6}),
       box({0, 0, 0}, {1, 5, 6})},
      {"strided rows",
       {6, 8},
       box({1, 3}, {4, 4}),
       {4, 4},
       box({0, 0}, {4, 4}),
       box({0, 0}, {4, 4}),
       false,
       true},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    Copy c;
    c.src_param = 0;
    c.dst_param = 0;
    c.src_box = k.src_box;
    c.dst_box = k.dst_box;
    c.hf_box = k.hf_box;
    c.view_box = k.hf_box;
    c.transpose = k.transpose;
    c.dtype = DType::BF16;
    c.bytes = k.hf_box.numel() * 2;
    // The source: 2-byte elements numbered, through a padded view or not.
    Storage src = make_storage(DType::BF16, k.src_shape, k.padded);
    for (size_t i = 0; i < src.bytes.size() / 2; ++i) {
      const auto v = static_cast<uint16_t>(i + 1);
      std::memcpy(src.bytes.data() + 2 * i, &v, 2);
    }
    const TensorView& sv = src.view;
    std::vector<uint16_t> two_copies(static_cast<size_t>(numel(k.dst_shape)), 0);
    std::vector<uint16_t> one_copy = two_copies;
    std::vector<char> slot(static_cast<size_t>(c.bytes));
    CopyProgram pack, apply, once;
    pipeline::add_pack(pack, c, sv, 0);
    execute_host(pack, 0, pipeline::addr(slot.data()));
    pipeline::add_apply(apply, c, host_view(two_copies.data(), DType::BF16, k.dst_shape), 0);
    execute_host(apply, pipeline::addr(slot.data()), 0);
    pipeline::add_pack_apply(once, c, sv, host_view(one_copy.data(), DType::BF16, k.dst_shape));
    execute_host(once, 0, 0);
    EXPECT_EQ(std::count(two_copies.begin(), two_copies.end(), 0),
              numel(k.dst_shape) - k.hf_box.numel())
        << "the box was written";
    EXPECT_EQ(one_copy, two_copies);
  }
  // An item not packed as its HF box (a broadcast apply item's view) or
  // quantized by its sender has no one-copy form.
  Copy c;
  c.src_box = c.dst_box = c.hf_box = box({0, 0}, {2, 2});
  c.view_box = box({0, 0}, {4, 2});
  std::vector<uint16_t> a(8), b(8);
  CopyProgram p;
  EXPECT_THROW(pipeline::add_pack_apply(p, c, host_view(a.data(), DType::BF16, {4, 2}),
                                        host_view(b.data(), DType::BF16, {4, 2})),
               Error);
}

TEST(Wire, OptionsJson) {
  WireOptions w;
  w.checksums = false;
  w.checksums_gpu = true;
  w.direct_min_bytes = 12345;
  w.lend = false;
  const WireOptions back = WireOptions::from_json(w.to_json());
  EXPECT_FALSE(back.checksums);
  EXPECT_TRUE(back.checksums_gpu);
  EXPECT_EQ(back.direct_min_bytes, 12345);
  EXPECT_FALSE(back.lend);
  EXPECT_TRUE(WireOptions::from_json(nlohmann::json::object()).checksums) << "on by default";
  EXPECT_FALSE(WireOptions::from_json(nlohmann::json::object()).checksums_gpu);
  EXPECT_TRUE(WireOptions::from_json(nlohmann::json::object()).lend) << "on by default";
  for (const char* bad : {R"({"checksums": "yes"})", R"({"checksums_gpu": 1})", R"({"lend": 1})",
                          R"({"direct_min_bytes": 0})", R"({"direct_min_bytes": 1.5})", R"([1])"}) {
    try {
      WireOptions::from_json(nlohmann::json::parse(bad));
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument) << bad;
      EXPECT_NE(std::string(e.what()).find("wire options"), std::string::npos) << e.what();
    }
  }
}

// apply_frame says which items' encodings changed an element: exactly the
// items whose bytes differ (load_weights mode hands only those tensors).
TEST(Wire, DeltaFramesSayWhichItemsChanged) {
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const Plan plan = plan_of(m, "p2p", 8192);
  const Bucket& b = plan.buckets().at(1);
  const auto items = pipeline::frame_items(plan, b.id);
  ASSERT_GE(items.size(), 3u);
  std::vector<char> old(static_cast<size_t>(b.bytes));
  for (size_t i = 0; i < old.size(); ++i) old[i] = static_cast<char>(i * 131 + 7);
  for (size_t pick = 0; pick < 3; ++pick) {
    // Every third item changes, from item `pick` on; in one of them a
    // single byte only (its last).
    std::vector<char> next = old, base = old;
    std::vector<bool> expected(items.size(), false);
    for (size_t i = pick; i < items.size(); i += 3) {
      const auto& f = items[i];
      if (f.bytes == 0) continue;
      expected[i] = true;
      if (i == pick) {
        next[static_cast<size_t>(f.offset + f.bytes - 1)] ^= 0x01;
        continue;
      }
      for (int64_t at = f.offset; at < f.offset + f.bytes; at += 61)
        next[static_cast<size_t>(at)] ^= 0x10;
    }
    std::vector<char> frame(static_cast<size_t>(pipeline::frame_capacity(items, b.bytes)));
    std::vector<const char*> sources;
    for (const auto& f : items) sources.push_back(next.data() + f.offset);
    const int64_t n =
        pipeline::encode_frame(items, sources.data(), base.data(), frame.data(), nullptr, 3);
    std::vector<char> target = old;
    std::vector<char*> targets;
    for (const auto& f : items) targets.push_back(target.data() + f.offset);
    std::vector<bool> changed;
    pipeline::apply_frame(items, frame.data(), n, targets.data(), "bucket 1", 3, nullptr, &changed);
    EXPECT_EQ(target, next);
    EXPECT_EQ(changed, expected) << "from item " << pick;
    // The GPU's tables say the same.
    std::vector<int64_t> offsets;
    for (const auto& f : items) offsets.push_back(f.offset);
    pipeline::FrameTables tables;
    std::vector<bool> table_changed;
    pipeline::frame_tables(items, frame.data(), n, offsets.data(), "bucket 1", 3, false, tables,
                           &table_changed);
    EXPECT_EQ(table_changed, expected) << "from item " << pick;
  }
}

// Delta sync's frames (pipeline/delta_frame.h): a bucket of a real plan
// encoded against its previous version and applied to that version gives
// the new bytes; a frame that is not one, or whose table or encodings are
// damaged, is refused naming the bucket and writes nothing.
TEST(Wire, DeltaFramesRoundTripAndRefuseDamage) {
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const Plan plan = plan_of(m, "p2p", 8192);
  const Bucket& b = plan.buckets().at(1);
  const auto items = pipeline::frame_items(plan, b.id);
  ASSERT_FALSE(items.empty());
  std::vector<char> old(static_cast<size_t>(b.bytes)), next;
  for (size_t i = 0; i < old.size(); ++i) old[i] = static_cast<char>(i * 131 + 7);
  next = old;
  for (size_t i = 0; i < next.size(); i += 97) next[i] = static_cast<char>(next[i] ^ 0x10);
  std::vector<char> base = old;
  std::vector<char> frame(static_cast<size_t>(pipeline::frame_capacity(items, b.bytes)));
  std::vector<const char*> sources;
  for (const auto& f : items) sources.push_back(next.data() + f.offset);
  uint64_t sent_digest = 0;
  const int64_t n = pipeline::encode_frame(items, sources.data(), base.data(), frame.data(),
                                           nullptr, 9, &sent_digest);
  EXPECT_EQ(base, next) << "the sender's copy follows what it sent";
  EXPECT_EQ(sent_digest, pipeline::frame_digest(items, sources.data(), 9))
      << "the encoder's digest is the new bytes'";
  EXPECT_LT(n, b.bytes / 2) << "about 1 % of the bytes changed";
  pipeline::FrameHeader h;
  h.delta = true;
  h.step = 9;
  h.base = 8;
  h.has_digest = true;
  h.digest = 0x1234;
  pipeline::store_frame_header(frame.data(), h);
  const pipeline::FrameHeader r = pipeline::read_frame_header(frame.data(), n, "bucket 1");
  EXPECT_TRUE(r.delta && r.has_digest);
  EXPECT_EQ(r.step, 9);
  EXPECT_EQ(r.base, 8);
  EXPECT_EQ(r.digest, 0x1234u);
  std::vector<char> target = old;
  auto targets_in = [&](std::vector<char>& bucket) {
    std::vector<char*> out;
    for (const auto& f : items) out.push_back(bucket.data() + f.offset);
    return out;
  };
  uint64_t applied_digest = 0;
  pipeline::apply_frame(items, frame.data(), n, targets_in(target).data(), "bucket 1", 9,
                        &applied_digest);
  EXPECT_EQ(target, next);
  EXPECT_EQ(applied_digest, sent_digest) << "the patched bytes hash as the sender's";

  // The GPU's way (tables built and checked here, run as the kernels run
  // them): the same bytes and the same digest. Targets are offsets into
  // the bucket, as the subscriber gives device addresses.
  std::vector<int64_t> offsets;
  for (const auto& f : items) offsets.push_back(f.offset);
  pipeline::FrameTables tables;
  pipeline::frame_tables(items, frame.data(), n, offsets.data(), "bucket 1", 9, true, tables);
  EXPECT_FALSE(tables.patch.empty());
  std::vector<char> on_device = old;
  delta::execute_patch_host(tables.patch, frame.data(), on_device.data());
  EXPECT_EQ(on_device, next);
  EXPECT_EQ(delta::execute_hash_host(tables.hash, on_device.data()), sent_digest);

  auto refused = [&](const std::vector<char>& f, int64_t bytes, const std::string& says) {
    std::vector<char> t = old;
    try {
      pipeline::apply_frame(items, f.data(), bytes, targets_in(t).data(),
                            "bucket 1 from trainer rank 0");
      ADD_FAILURE() << "accepted a frame that should say: " << says;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::format);
      EXPECT_NE(std::string(e.what()).find("bucket 1 from trainer rank 0"), std::string::npos);
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
    EXPECT_EQ(t, old) << says << ": the frame is checked before anything is written";
    std::vector<int64_t> offsets;
    for (const auto& it : items) offsets.push_back(it.offset);
    pipeline::FrameTables tables;
    try {
      pipeline::frame_tables(items, f.data(), bytes, offsets.data(), "bucket 1 from trainer rank 0",
                             0, true, tables);
      ADD_FAILURE() << "tables for a frame that should say: " << says;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::format);
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused(frame, pipeline::kFrameHeaderBytes + 4, "cannot hold the table");
  std::vector<char> lying = frame;
  lying[pipeline::kFrameHeaderBytes] = 0x7f;  // item 0 claims more than the frame holds
  lying[pipeline::kFrameHeaderBytes + 3] = 0x7f;
  refused(lying, n, "item 0 claims");
  std::vector<char> longer = frame;
  longer.resize(static_cast<size_t>(n) + 3);
  refused(longer, n + 3, "left over");
  std::vector<char> junk(64, 'x');
  try {
    pipeline::read_frame_header(junk.data(), 64, "bucket 1");
    ADD_FAILURE() << "junk read as a frame";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::format);
    EXPECT_NE(std::string(e.what()).find("not a delta-sync frame"), std::string::npos);
  }
}

// Broadcast plans: each engine template's digest covers exactly what its
// apply items read, row by row: the same value as each read gathered
// row-major and hashed in one piece, and a byte it reads changes it.
TEST(Wire, BroadcastReadsDigestCoversWhatATemplateReads) {
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 1);
  const Plan plan = plan_of(m, "broadcast", 8192);
  ASSERT_EQ(plan.engine_templates(), 2);
  bool partial = false;  // some read is a strict part of its view
  for (const Bucket& b : plan.buckets()) {
    std::vector<char> bucket(static_cast<size_t>(b.bytes));
    for (size_t i = 0; i < bucket.size(); ++i) bucket[i] = static_cast<char>(i * 131 + b.id);
    for (int t = 0; t < plan.engine_templates(); ++t) {
      const auto reads = pipeline::template_reads(plan, b.id, t);
      uint64_t expected = 0;
      for (size_t i = 0; i < reads.size(); ++i) {
        const auto& r = reads[i];
        partial = partial || r.hf_box.lengths != r.view_box.lengths;
        const DType dtype = r.element_bytes == 2 ? DType::BF16 : DType::F32;
        ASSERT_EQ(static_cast<int>(itemsize(dtype)), r.element_bytes);
        std::vector<char> gathered(static_cast<size_t>(r.hf_box.numel() * r.element_bytes));
        const TensorView view = host_view(bucket.data() + r.offset, dtype, r.view_box.lengths);
        Box inside = r.hf_box;
        for (size_t d = 0; d < inside.rank(); ++d) inside.offsets[d] -= r.view_box.offsets[d];
        copy_box(view, inside, host_view(gathered.data(), dtype, r.hf_box.lengths),
                 Box::full(r.hf_box.lengths));
        expected = checksum_fold(expected, checksum64(gathered.data(), gathered.size(),
                                                      fragment_seed(5, static_cast<uint32_t>(i))));
      }
      EXPECT_EQ(pipeline::reads_digest(reads, bucket.data(), 5), expected)
          << "bucket " << b.id << ", template " << t;
      if (!reads.empty()) {
        // The first byte of the last read's last row changes the digest.
        const auto& r = reads.back();
        std::vector<char> changed = bucket;
        const Shape strides = contiguous_strides(r.view_box.lengths);
        int64_t element = 0;
        for (size_t d = 0; d < r.hf_box.rank(); ++d)
          element += (r.hf_box.offsets[d] - r.view_box.offsets[d] +
                      (d + 1 < r.hf_box.rank() ? r.hf_box.lengths[d] - 1 : 0)) *
                     strides[d];
        changed[static_cast<size_t>(r.offset + element * r.element_bytes)] ^= 1;
        EXPECT_NE(pipeline::reads_digest(reads, changed.data(), 5), expected)
            << "bucket " << b.id << ", template " << t;
      }
    }
  }
  EXPECT_TRUE(partial) << "no read is a strict part of its view: the row walk went untested";
}

TEST(Wire, FragmentsCoverEachBucketBackToBack) {
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const Plan plan = plan_of(m, "p2p", 8192);
  for (const int64_t min : {int64_t{1}, int64_t{512}, int64_t{1} << 40}) {
    for (const Bucket& b : plan.buckets()) {
      const auto items = plan.items(b.id);
      const auto frags = bucket_fragments(plan, b.id, min);
      int64_t next = 0;
      uint32_t item = 0;
      for (const Fragment& f : frags) {
        EXPECT_EQ(f.offset, next) << "bucket " << b.id;
        EXPECT_EQ(f.first, item) << "bucket " << b.id;
        int64_t bytes = 0;
        for (uint32_t i = f.first; i < f.first + f.count; ++i) {
          const int64_t n = plan.resolve(items[i]).bytes;
          bytes += n;
          // A big item travels alone; small ones are grouped.
          if (n >= min) {
            EXPECT_EQ(f.count, 1u) << "bucket " << b.id << " item " << i;
          }
        }
        EXPECT_EQ(f.bytes, bytes);
        next += f.bytes;
        item += f.count;
      }
      EXPECT_EQ(next, b.bytes) << "bucket " << b.id;
      EXPECT_EQ(item, items.size()) << "bucket " << b.id;
      if (min == 1) {
        EXPECT_EQ(frags.size(), items.size());
      }
      if (min == (int64_t{1} << 40)) {
        EXPECT_EQ(frags.size(), 1u);
      }
      WireOptions w;
      w.checksums = false;  // on by default
      w.direct_min_bytes = min;
      EXPECT_EQ(bucket_messages(plan, b.id, w), static_cast<int64_t>(frags.size()));
      w.checksums = true;
      EXPECT_EQ(bucket_messages(plan, b.id, w), static_cast<int64_t>(frags.size()) + 1);
      w.delta = true;
      EXPECT_EQ(bucket_messages(plan, b.id, w), static_cast<int64_t>(frags.size()) + 2);
    }
  }
}

struct WireCase {
  bool checksums;
  int64_t direct_min_bytes;
  bool padded;  // every other tensor registered through a padded view
};

class WireSync : public ::testing::TestWithParam<WireCase> {};

// One trainer rank, one replica of tp=2 (row-parallel weights are column
// slices: packed on the trainer, dense in the engine), two steps.
TEST_P(WireSync, ParamsBitExactAndZeroCopyWhereDense) {
  const auto names = transport_names();
  if (std::find(names.begin(), names.end(), "ucx") == names.end())
    GTEST_SKIP() << "weightsync was built without UCX";
  const WireCase wc = GetParam();
  const Model m = make_model("tiny-llama", "fsdp=1", 2, 1);
  const Checkpoint ckpt = Checkpoint::open(m.checkpoint);
  const TrainerLayout layout = TrainerLayout::load(m.trainer);
  const EngineConfig config = load_engine_config(m.engine);
  const EngineLayout engine_layout = make_engine_layout(config);
  control::Coordinator coordinator(control::CoordinatorOptions{});

  std::vector<std::vector<Storage>> params(2);
  std::vector<StepOutcome> last(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> engines;
  for (int r = 0; r < 2; ++r) {
    const EngineRankLayout& rl = engine_layout.rank_layout(r);
    for (size_t i = 0; i < rl.params.size(); ++i)
      params[r].push_back(
          make_storage(rl.params[i].dtype, rl.params[i].shape, wc.padded && i % 2 == 1));
    engines.emplace_back([&, r, rl] {
      try {
        SubscriberOptions so;
        so.coordinator = coordinator.address();
        so.engine = config;
        so.rank = r;
        Subscriber sub(so);
        for (size_t i = 0; i < rl.params.size(); ++i)
          sub.register_param(rl.params[i].name, params[r][i].view);
        for (int i = 0; i < 200 && sub.version() < 2; ++i)
          if (auto o = sub.run_step(std::chrono::milliseconds(200))) last[r] = *o;
      } catch (const Error& e) {
        errors[r] = e.what();
      }
    });
  }
  std::vector<Storage> shards;
  PushResult result;
  std::string trainer_error;
  size_t staging = 0;
  try {
    PublisherOptions po;
    po.coordinator = coordinator.address();
    po.layout = layout;
    po.engine = config;
    po.plan.bucket_bytes = 16384;
    po.wire.checksums = wc.checksums;
    po.wire.direct_min_bytes = wc.direct_min_bytes;
    Publisher pub(po);
    for (size_t i = 0; i < layout.params.size(); ++i) {
      const LoadSpec& spec = layout.params[i];
      shards.push_back(
          make_storage(spec.dtype, local_shape(spec, layout.mesh, 0), wc.padded && i % 2 == 0));
      const TensorView& v = shards.back().view;
      std::vector<char> dense(static_cast<size_t>(v.numel()) * itemsize(v.dtype));
      fill_local_tensor(ckpt, spec, layout.mesh, 0, host_view(dense.data(), v.dtype, v.shape));
      copy_box(host_view(dense.data(), v.dtype, v.shape), Box::full(v.shape), v,
               Box::full(v.shape));
      pub.register_tensor(spec.name, shards.back().view);
    }
    for (int64_t step = 1; step <= 2; ++step) {
      result = pub.push(step);
      EXPECT_EQ(result.committed, (std::vector<int>{0, 1})) << "step " << step;
    }
    staging = pub.staging_bytes();
  } catch (const Error& e) {
    trainer_error = e.what();
  }
  for (auto& t : engines) t.join();
  ASSERT_EQ(trainer_error, "");
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "") << "engine rank " << r;
    EXPECT_TRUE(last[r].committed) << last[r].reason;
    EXPECT_EQ(last[r].checksum != 0, wc.checksums) << "the ack carries a checksum iff checked";
    const EngineRankLayout& rl = engine_layout.rank_layout(r);
    for (size_t i = 0; i < rl.params.size(); ++i) {
      std::vector<char> expected(static_cast<size_t>(numel(rl.params[i].shape)) *
                                 itemsize(rl.params[i].dtype));
      fill_param(ckpt, rl.params[i], expected.data());
      std::vector<char> got(expected.size());
      copy_box(params[r][i].view, Box::full(rl.params[i].shape),
               host_view(got.data(), rl.params[i].dtype, rl.params[i].shape),
               Box::full(rl.params[i].shape));
      EXPECT_EQ(got, expected) << "engine rank " << r << " " << rl.params[i].name;
    }
  }
  // What went zero-copy: nothing when every item is packed; with small
  // fragments some bytes, but not all (column slices are never dense on the
  // trainer).
  if (wc.direct_min_bytes > (int64_t{1} << 30)) {
    EXPECT_EQ(result.bytes_direct, 0u);
    EXPECT_EQ(last[0].bytes_direct + last[1].bytes_direct, 0u);
  } else {
    EXPECT_GT(result.bytes_direct, 0u);
    EXPECT_LT(result.bytes_direct, result.bytes_sent);
    EXPECT_GT(last[0].bytes_direct, 0u);
  }
  EXPECT_LE(staging, 2 * (16384 + 8)) << "two bucket slots at most";
}

INSTANTIATE_TEST_SUITE_P(Wire, WireSync,
                         ::testing::Values(WireCase{false, 256, false}, WireCase{true, 256, false},
                                           WireCase{false, int64_t{1} << 40, false},
                                           WireCase{true, int64_t{1} << 40, true},
                                           WireCase{true, 256, true}, WireCase{false, 1, true}),
                         [](const auto& info) {
                           const WireCase& c = info.param;
                           return std::string(c.checksums ? "Checked" : "Unchecked") +
                                  (c.direct_min_bytes > (int64_t{1} << 30) ? "AllPacked"
                                                                           : "Direct") +
                                  (c.padded ? "PaddedViews" : "Dense");
                         });

}  // namespace
}  // namespace weightsync::e2e
