// SavePipeline::run: one loop driving both sides of the save (sends to the
// other writers, receives for this rank's files) and handing complete keys
// to the disk thread; see checkpoint_save.h for why it cannot deadlock.
#include "checkpoint_save.h"

#include <weightsync/checksum.h>
#include <weightsync/error.h>

#include "transport/staging.h"

#include <algorithm>

namespace weightsync::trainer {
namespace {

using Clock = std::chrono::steady_clock;

std::uintptr_t addr(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p);
}

}  // namespace

bool SavePipeline::complete(Slot& slot) {
  for (auto& r : slot.posted)
    if (!r->test()) return false;
  return true;
}

void SavePipeline::wait(const std::function<bool()>& ready,
                        const std::function<std::string()>& what) {
  auto last_poll = Clock::now();
  int spins = 0;
  while (!ready()) {
    const auto now = Clock::now();
    if (now >= deadline_) fail(Errc::timeout, who_, ": ", what(), " did not end in time");
    if (now - last_poll >= std::chrono::milliseconds(1)) {
      last_poll = now;
      if (poll_) poll_();
      writer_->check();
    }
    if (transport_) transport_->progress();
    poll_pause(spins);
  }
}

// Frees send slots whose transfers completed and posts the next sends into
// them. True when anything moved.
bool SavePipeline::sends_step(int64_t tag_step) {
  bool moved = false;
  for (Slot& slot : send_slots_) {
    if (!slot.posted.empty()) {
      if (!complete(slot)) continue;
      slot.posted.clear();
      moved = true;
    }
    if (next_send_ >= sends_.size()) continue;
    const size_t index = next_send_++;
    const SendAction& a = sends_[index];
    const int s = static_cast<int>(&slot - send_slots_);
    if (!a.pack.empty()) {
      pack_copier_.run(index, a.pack, 0, addr(slot.buffer.data), s);
      pack_copier_.wait(s, *loop_, "packing a save bucket");
    }
    const Tag tag = bucket_tag(tag_step, a.bucket, 0);
    for (const FragmentRoute& f : a.fragments) {
      const Buffer b = f.direct ? Buffer{const_cast<char*>(f.direct), static_cast<size_t>(f.bytes),
                                         f.memory, f.device, nullptr}
                                : slot.buffer.buffer(static_cast<size_t>(f.slot_offset),
                                                     static_cast<size_t>(f.bytes));
      // In fragment order: the writer matches them in that order (wire.h).
      slot.posted.push_back(transport_->send(a.peer, tag, b));
    }
    slot.action = index;
    stats_.bytes_sent += static_cast<uint64_t>(a.bytes);
    moved = true;
  }
  return moved;
}

void SavePipeline::post_receive(size_t k, int64_t tag_step) {
  if (k >= receives_.size()) return;
  const RecvAction& a = receives_[k];
  Slot& slot = recv_slots_[k % 2];
  const Tag tag = bucket_tag(tag_step, a.bucket, 0);
  for (const FragmentRoute& f : a.fragments) {
    const Buffer b = f.direct ? Buffer{f.direct, static_cast<size_t>(f.bytes), MemoryKind::host, -1,
                                       arena_region_.get()}
                              : slot.buffer.buffer(static_cast<size_t>(f.slot_offset),
                                                   static_cast<size_t>(f.bytes));
    slot.posted.push_back(transport_->recv(a.peer, tag, b));
  }
  slot.action = k;
  next_post_ = k + 1;
}

// Receive k landed: its messages must be whole (sizes come from the plan on
// both sides), then its packed fragments are applied into the arena.
void SavePipeline::settle(size_t k) {
  Slot& slot = recv_slots_[k % 2];
  const RecvAction& a = receives_[k];
  for (const auto& r : slot.posted)
    if (r->transferred() != r->bytes())
      fail(Errc::peer_failure, who_, ": ", r->describe(), " brought ", r->transferred(),
           " bytes, expected ", r->bytes(), " (does trainer rank ", a.peer,
           " save with the same layout and options?)");
  slot.posted.clear();
  if (!a.apply.empty()) {
    apply_copier_.run(k, a.apply, addr(slot.buffer.data), 0, static_cast<int>(k % 2));
    apply_copier_.wait(static_cast<int>(k % 2), *loop_, "applying a save bucket");
  }
  stats_.bytes_received += static_cast<uint64_t>(a.bytes);
}

bool SavePipeline::receives_step(int64_t tag_step) {
  if (next_settle_ >= receives_.size() || next_settle_ >= next_post_) return false;
  if (!complete(recv_slots_[next_settle_ % 2])) return false;
  const size_t k = next_settle_++;
  settle(k);
  const auto t = static_cast<int64_t>(k);
  wait_disk(t);
  hand_off(t);
  post_receive(k + 2, tag_step);
  return true;
}

// Before anything lands at time t: the keys whose places it may take are on disk.
void SavePipeline::wait_disk(int64_t t) {
  const size_t need = written_before(arena_plan_, t);
  if (writer_->done() >= need) return;
  const auto start = Clock::now();
  wait([&] { return writer_->done() >= need; },
       [&] { return cat("writing key ", need, " of ", writer_->size(), " to disk"); });
  stats_.disk_wait_s += std::chrono::duration<double>(Clock::now() - start).count();
}

// The keys complete at time t go to the disk thread, in writing order; the
// parts this rank holds itself are copied into the arena first.
void SavePipeline::hand_off(int64_t t) {
  for (size_t i : arena_plan_.handed_at[static_cast<size_t>(t + 1)]) {
    const Local& l = locals_[i];
    if (l.program >= 0) {
      local_copier_.run(static_cast<size_t>(l.program), l.copy, 0, 0, 0);
      local_copier_.finish();  // a device-to-host copy of one key's parts
    }
    std::vector<FileWriter::Run> runs;
    for (const Local::Run& r : l.runs)
      runs.push_back({r.shard ? r.shard : arena_ + arena_plan_.offset[i] + r.offset,
                      static_cast<size_t>(r.bytes)});
    writer_->push(i, std::move(runs));
  }
}

SaveStats SavePipeline::run(const std::string& dir, bool sync, bool direct_io, int64_t tag_step,
                            Transport* transport, const std::function<void()>& poll,
                            Clock::time_point deadline) {
  pipeline::use_device(memory_);  // this thread may be new
  const double cpu_start = thread_cpu_seconds();
  transport_ = transport;
  poll_ = poll;
  deadline_ = deadline;
  if (transport) loop_.emplace(who_, *transport, poll, deadline);
  writer_ = std::make_unique<FileWriter>(wl_, rank_, arena_plan_.order, dir, sync, direct_io);
  next_send_ = next_post_ = next_settle_ = 0;
  wait_disk(-1);
  hand_off(-1);
  post_receive(0, tag_step);
  post_receive(1, tag_step);
  auto last_poll = Clock::now();
  int spins = 0;
  auto sends_left = [&] {
    return next_send_ < sends_.size() || !send_slots_[0].posted.empty() ||
           !send_slots_[1].posted.empty();
  };
  while (sends_left() || next_settle_ < receives_.size()) {
    const bool moved = (transport_ && sends_step(tag_step)) | receives_step(tag_step);
    const auto now = Clock::now();
    if (moved) spins = 0;
    if (now >= deadline_)
      fail(Errc::timeout, who_, ": the save's transfers did not end in time (sent ", next_send_,
           " of ", sends_.size(), " buckets, received ", next_settle_, " of ", receives_.size(),
           ")");
    if (now - last_poll >= std::chrono::milliseconds(1)) {
      last_poll = now;
      if (poll_) poll_();
      writer_->check();
    }
    if (!moved) {
      if (transport_) transport_->progress();
      poll_pause(spins);
    }
  }
  wait([&] { return writer_->done() == writer_->size(); },
       [&] {
         return cat("writing this rank's files (", writer_->done(), " of ", writer_->size(),
                    " keys written)");
       });
  writer_->check();
  if (sync && writer_->size() > 0) fsync_path(dir, true);  // the renames
  SaveStats out = stats_;
  out.bytes_written = writer_->bytes_written();
  out.files = writer_->written_files();
  out.disk_s = writer_->busy_seconds();
  out.disk_cpu_s = writer_->cpu_seconds();
  out.data_cpu_s = thread_cpu_seconds() - cpu_start;
  writer_.reset();
  loop_.reset();
  return out;
}

std::vector<int> SavePipeline::peers() const {
  std::vector<int> out;
  for (const SendAction& a : sends_) out.push_back(a.peer);
  for (const RecvAction& a : receives_) out.push_back(a.peer);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

void SavePipeline::cancel_all() {
  for (Slot* slots : {send_slots_, recv_slots_})
    for (int s = 0; s < 2; ++s) {
      for (auto& r : slots[s].posted) r->cancel();
      slots[s].posted.clear();
    }
}

}  // namespace weightsync::trainer
