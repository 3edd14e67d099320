// The schedule and its cost model (docs/planner.md, "Cost model").
//
// Every NIC (and, between GPUs of one node, every GPU's NVLink port) is a
// resource with a send side and a receive side (full duplex). A transfer holds
// the send side of its source and the receive side of its destination for
// latency + bytes / min(bandwidths): one transfer at a time per side, which is
// what a schedule without incast achieves on real fabrics. p2p: greedy list
// scheduling; a free receiver takes the pending bucket whose sender has the
// most work left (longest-remaining-first keeps every sender busy to the end).
#include "plan_builder.h"

#include <weightsync/error.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <queue>

namespace weightsync {
namespace {

struct Link {
  int tx = 0, rx = 0;  // resource ids
  double bw = 1, lat = 0;
};

// Resource ids for NICs and NVLink ports, and the link between two GPUs.
class Fabric {
 public:
  Fabric(const Topology& topo, int trainer_world, int engine_world) : topo_(topo) {
    for (int t = 0; t < trainer_world; ++t)
      trainer_.push_back(
          place(topo.trainer_node(t, trainer_world), topo.trainer_slot(t, trainer_world)));
    for (int g = 0; g < engine_world; ++g)
      engine_.push_back(
          place(topo.engine_node(g, trainer_world), topo.engine_slot(g, trainer_world)));
    bw_.resize(ids_.size());
    lat_.resize(ids_.size());
    for (const auto& [k, id] : ids_) {
      const bool nic = std::get<0>(k) == 0;
      bw_[static_cast<size_t>(id)] =
          1e9 * (nic ? topo.nic_bandwidth_GBps : topo.nvlink_bandwidth_GBps);
      lat_[static_cast<size_t>(id)] = 1e-6 * (nic ? topo.nic_latency_us : topo.nvlink_latency_us);
    }
  }
  int resources() const { return static_cast<int>(ids_.size()); }
  double bw(int res) const { return bw_[static_cast<size_t>(res)]; }
  double lat(int res) const { return lat_[static_cast<size_t>(res)]; }
  Link trainer_to_engine(int t, int g) const { return link(trainer_[t], engine_[g]); }
  Link trainer_to_trainer(int a, int b) const { return link(trainer_[a], trainer_[b]); }
  int engine_nic(int g) const { return engine_[static_cast<size_t>(g)].nic; }
  int trainer_nic(int t) const { return trainer_[static_cast<size_t>(t)].nic; }

 private:
  struct Gpu {
    int node = 0, nic = 0, nvlink = 0;
  };
  Gpu place(int node, int slot) {
    return {node, id({0, node, slot / topo_.gpus_per_nic}), id({1, node, slot})};
  }
  int id(std::tuple<int, int, int> key) {
    return ids_.emplace(key, static_cast<int>(ids_.size())).first->second;
  }
  Link link(const Gpu& a, const Gpu& b) const {
    Link l;
    if (a.node == b.node) {
      l.tx = a.nvlink, l.rx = b.nvlink;
    } else {
      l.tx = a.nic, l.rx = b.nic;
    }
    l.bw = std::min(bw(l.tx), bw(l.rx));
    l.lat = std::max(lat(l.tx), lat(l.rx));
    return l;
  }
  const Topology& topo_;
  std::map<std::tuple<int, int, int>, int> ids_;  // (0 nic | 1 nvlink, node, index)
  std::vector<Gpu> trainer_, engine_;
  std::vector<double> bw_, lat_;
};

// Busiest side of any resource: its bytes over its bandwidth, plus one latency.
double lower_bound(const Fabric& fabric, const std::vector<double>& tx_bytes,
                   const std::vector<double>& rx_bytes) {
  double lb = 0;
  for (int r = 0; r < fabric.resources(); ++r) {
    const size_t i = static_cast<size_t>(r);
    for (double b : {tx_bytes[i], rx_bytes[i]})
      if (b > 0) lb = std::max(lb, fabric.lat(r) + b / fabric.bw(r));
  }
  return lb;
}

struct Job {
  int tx = 0, rx = 0;
  double dur = 0;
};

// `ids` reordered by the resource `side` of their jobs, keeping their order
// among equal resources.
std::vector<int32_t> stable_order(const std::vector<int32_t>& ids, int resources, int Job::*side,
                                  const std::vector<Job>& jobs) {
  std::vector<uint32_t> next(static_cast<size_t>(resources) + 1, 0);
  for (int32_t j : ids) ++next[static_cast<size_t>(jobs[static_cast<size_t>(j)].*side) + 1];
  for (size_t r = 1; r < next.size(); ++r) next[r] += next[r - 1];
  std::vector<int32_t> out(ids.size());
  for (int32_t j : ids) out[next[static_cast<size_t>(jobs[static_cast<size_t>(j)].*side)]++] = j;
  return out;
}

// Greedy list scheduling of p2p jobs; returns each job's start time.
//
// When a side (a resource's send or receive side) is free it takes, among its
// pending jobs whose other side is free, the one whose other side has the most
// work left (ties: the lowest job id). The jobs of one (tx, rx) pair tie on
// everything but their id, so they wait per pair in id order and only a
// pair's first job is a candidate. A pick scans the smaller of the side's
// pairs with pending jobs and the other sides that are free with work left:
// while the fabric is busy the latter are few, which keeps a pick far below
// a scan of all pending jobs (hundreds per NIC at 1T scale). Both scans see
// the same candidates, so the choice does not depend on which one ran.
class ListScheduler {
 public:
  ListScheduler(const std::vector<Job>& jobs, int resources) : jobs_(jobs), start_(jobs.size(), 0) {
    build_pairs(resources);
    for (int s = 0; s < 2; ++s) init_side(sides_[s], s, resources);
    build_pair_table();
    for (const Job& job : jobs)
      sides_[0].left[job.tx] += job.dur, sides_[1].left[job.rx] += job.dur;
  }

  // Job ids in the order they started (by start time; not by id among ties).
  const std::vector<int32_t>& started() const { return started_; }

  std::vector<double> run() {
    const int n = static_cast<int>(sides_[1].busy.size());
    for (int r = 0; r < n; ++r) try_start(1, r, 0);
    for (int t = 0; t < n; ++t) try_start(0, t, 0);
    std::vector<int32_t> freed;
    while (!events_.empty()) {
      const double now = events_.top().first;
      freed.clear();
      while (!events_.empty() && events_.top().first == now) {
        freed.push_back(events_.top().second);
        events_.pop();
      }
      for (int32_t j : freed) release(0, jobs_[j].tx), release(1, jobs_[j].rx);
      for (int32_t j : freed) try_start(1, jobs_[j].rx, now);
      for (int32_t j : freed) try_start(0, jobs_[j].tx, now);
    }
    if (started_.size() != jobs_.size())
      fail(Errc::internal, "list scheduler: ", jobs_.size() - started_.size(), " of ", jobs_.size(),
           " buckets never started");
    return start_;
  }

 private:
  struct Pair {
    int32_t res[2];      // [0] tx, [1] rx
    uint32_t next, end;  // pending jobs: order_[next, end)
  };
  struct Side {
    std::vector<std::vector<int32_t>> pending;  // by resource: pairs with pending jobs
    std::vector<uint32_t> pos;                  // by pair: index in its pending list
    std::vector<uint32_t> first;                // by resource: its pairs in `sorted`
    std::vector<int32_t> sorted;                // by the other side's resource
    std::vector<int32_t> dense;                 // by resource: index among those with pairs
    size_t used = 0;                            // resources with pairs
    std::vector<char> busy;
    std::vector<double> left;      // work not yet started
    std::vector<int32_t> free;     // free resources with pending jobs (any order)
    std::vector<int32_t> in_free;  // by resource: index in `free`, or -1
  };

  // Pairs ordered by (tx, rx); their jobs in id order. Two stable counting
  // passes (by rx, then by tx) give that order without comparing: a
  // comparison sort of 10^5 buckets cost more than the rest of the setup.
  void build_pairs(int resources) {
    std::vector<int32_t> ids(jobs_.size());
    for (size_t j = 0; j < jobs_.size(); ++j) ids[j] = static_cast<int32_t>(j);
    order_ =
        stable_order(stable_order(ids, resources, &Job::rx, jobs_), resources, &Job::tx, jobs_);
    for (uint32_t k = 0; k < order_.size(); ++k) {
      const Job& job = jobs_[order_[k]];
      if (pairs_.empty() || pairs_.back().res[0] != job.tx || pairs_.back().res[1] != job.rx)
        pairs_.push_back({{job.tx, job.rx}, k, k});
      ++pairs_.back().end;
    }
  }
  // Pairs are sorted by (tx, rx), so a stable pass by resource leaves each
  // resource's pairs sorted by the other side's resource.
  void init_side(Side& side, int s, int resources) {
    const size_t n = static_cast<size_t>(resources);
    side.pending.assign(n, {});
    side.pos.resize(pairs_.size());
    side.first.assign(n + 1, 0);
    side.busy.assign(n, 0);
    side.left.assign(n, 0);
    side.in_free.assign(n, -1);
    for (const Pair& p : pairs_) ++side.first[static_cast<size_t>(p.res[s]) + 1];
    for (size_t r = 0; r < n; ++r) side.first[r + 1] += side.first[r];
    side.sorted.resize(pairs_.size());
    for (size_t p = 0; p < pairs_.size(); ++p) {
      auto& list = side.pending[static_cast<size_t>(pairs_[p].res[s])];
      side.pos[p] = static_cast<uint32_t>(list.size());
      side.sorted[side.first[static_cast<size_t>(pairs_[p].res[s])] + list.size()] =
          static_cast<int32_t>(p);
      list.push_back(static_cast<int32_t>(p));
    }
    side.dense.assign(n, -1);
    for (size_t r = 0; r < n; ++r)
      if (!side.pending[r].empty()) {
        side.dense[r] = static_cast<int32_t>(side.used++);
        set_free(side, static_cast<int32_t>(r), true);
      }
  }
  // A (tx, rx) -> pair table makes find_pair one load; it is skipped when it
  // would be large (then find_pair searches the resource's sorted pairs).
  void build_pair_table() {
    const size_t cells = sides_[0].used * sides_[1].used;
    if (cells > (size_t{1} << 22)) return;
    pair_at_.assign(cells, -1);
    for (size_t p = 0; p < pairs_.size(); ++p)
      pair_at_[cell(pairs_[p].res[0], pairs_[p].res[1])] = static_cast<int32_t>(p);
  }
  size_t cell(int32_t tx, int32_t rx) const {
    return static_cast<size_t>(sides_[0].dense[static_cast<size_t>(tx)]) * sides_[1].used +
           static_cast<size_t>(sides_[1].dense[static_cast<size_t>(rx)]);
  }
  static void set_free(Side& side, int32_t r, bool free) {
    int32_t& at = side.in_free[static_cast<size_t>(r)];
    if (free == (at >= 0)) return;
    if (free) {
      at = static_cast<int32_t>(side.free.size());
      side.free.push_back(r);
    } else {
      side.free[static_cast<size_t>(at)] = side.free.back();
      side.in_free[static_cast<size_t>(side.free.back())] = at;
      side.free.pop_back();
      at = -1;
    }
  }
  void release(int s, int32_t r) {
    Side& side = sides_[s];
    side.busy[static_cast<size_t>(r)] = 0;
    if (!side.pending[static_cast<size_t>(r)].empty()) set_free(side, r, true);
  }
  // The pair of side s's resource r with side o's resource q, or -1.
  int32_t find_pair(int s, int32_t r, int32_t q) const {
    if (!pair_at_.empty()) return s == 0 ? pair_at_[cell(r, q)] : pair_at_[cell(q, r)];
    const Side& side = sides_[s];
    const int o = 1 - s;
    auto b = side.sorted.begin() + side.first[static_cast<size_t>(r)];
    auto e = side.sorted.begin() + side.first[static_cast<size_t>(r) + 1];
    auto it = std::lower_bound(b, e, q, [&](int32_t p, int32_t v) { return pairs_[p].res[o] < v; });
    return it != e && pairs_[*it].res[o] == q ? *it : -1;
  }
  void try_start(int s, int32_t r, double now) {
    Side& side = sides_[s];
    const Side& other = sides_[1 - s];
    const auto& pending = side.pending[static_cast<size_t>(r)];
    if (side.busy[static_cast<size_t>(r)] || pending.empty()) return;
    int32_t best = -1, best_job = -1;
    double best_left = -1;
    auto consider = [&](int32_t p) {
      const Pair& pair = pairs_[p];
      const int32_t job = order_[pair.next];
      const double left = other.left[static_cast<size_t>(pair.res[1 - s])];
      if (left > best_left || (left == best_left && job < best_job))
        best = p, best_job = job, best_left = left;
    };
    if (other.free.size() < pending.size()) {
      for (int32_t q : other.free) {
        const int32_t p = find_pair(s, r, q);
        if (p >= 0 && pairs_[p].next < pairs_[p].end) consider(p);
      }
    } else {
      for (int32_t p : pending)
        if (!other.busy[static_cast<size_t>(pairs_[p].res[1 - s])]) consider(p);
    }
    if (best >= 0) start(best, now);
  }
  void start(int32_t p, double now) {
    Pair& pair = pairs_[p];
    const int32_t j = order_[pair.next++];
    for (int s = 0; s < 2; ++s) {
      Side& side = sides_[s];
      const size_t r = static_cast<size_t>(pair.res[s]);
      side.busy[r] = 1;
      side.left[r] -= jobs_[j].dur;
      set_free(side, pair.res[s], false);
      if (pair.next == pair.end) {  // the pair is done: drop it from the pending list
        auto& list = side.pending[r];
        const uint32_t at = side.pos[static_cast<size_t>(p)];
        list[at] = list.back();
        side.pos[static_cast<size_t>(list[at])] = at;
        list.pop_back();
      }
    }
    start_[j] = now;
    started_.push_back(j);
    events_.push({now + jobs_[j].dur, j});
  }

  const std::vector<Job>& jobs_;
  std::vector<double> start_;
  std::vector<int32_t> started_;  // job ids in the order they started
  std::vector<int32_t> order_;    // job ids by (tx, rx, id)
  std::vector<Pair> pairs_;
  std::vector<int32_t> pair_at_;  // by cell(tx, rx): the pair, or -1
  Side sides_[2];                 // [0] send sides, [1] receive sides
  using Event = std::pair<double, int32_t>;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
};

// Each rank's buckets by predicted start (ties: id), from the scheduler's
// start order (non-decreasing in time: events are processed in time order).
void order_by_start(const std::vector<double>& start, std::vector<int32_t> started,
                    const std::vector<Bucket>& buckets, std::vector<std::vector<int32_t>>& sent,
                    std::vector<std::vector<int32_t>>& received) {
  for (size_t i = 0, e = 0; i < started.size(); i = e) {
    const double t = start[static_cast<size_t>(started[i])];
    for (e = i + 1; e < started.size() && start[static_cast<size_t>(started[e])] == t;) ++e;
    std::sort(started.begin() + static_cast<ptrdiff_t>(i),
              started.begin() + static_cast<ptrdiff_t>(e));
  }
  std::vector<size_t> n_sent(sent.size(), 0), n_received(received.size(), 0);
  for (const Bucket& b : buckets)
    ++n_sent[static_cast<size_t>(b.src_rank)], ++n_received[static_cast<size_t>(b.dst_rank)];
  for (size_t r = 0; r < sent.size(); ++r) sent[r].reserve(n_sent[r]);
  for (size_t r = 0; r < received.size(); ++r) received[r].reserve(n_received[r]);
  for (int32_t id : started) {
    const Bucket& b = buckets[static_cast<size_t>(id)];
    sent[static_cast<size_t>(b.src_rank)].push_back(id);
    received[static_cast<size_t>(b.dst_rank)].push_back(id);
  }
}

}  // namespace

void PlanBuilder::schedule_p2p(Plan& plan, const Topology& topology) {
  const Fabric fabric(topology, plan.trainer_world_, plan.engine_world_);
  const size_t nres = static_cast<size_t>(fabric.resources());
  std::vector<double> tx_bytes(nres, 0), rx_bytes(nres, 0);
  std::vector<Job> jobs(plan.buckets_.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Bucket& b = plan.buckets_[i];
    const Link l = fabric.trainer_to_engine(b.src_rank, b.dst_rank);
    jobs[i] = {l.tx, l.rx, l.lat + static_cast<double>(b.bytes) / l.bw};
    tx_bytes[static_cast<size_t>(l.tx)] += static_cast<double>(b.bytes);
    rx_bytes[static_cast<size_t>(l.rx)] += static_cast<double>(b.bytes);
  }
  ListScheduler scheduler(jobs, fabric.resources());
  const std::vector<double> start = scheduler.run();
  PlanStats& st = plan.stats_;
  st.bytes_per_engine_rank.assign(static_cast<size_t>(plan.engine_world_), 0);
  st.bytes_per_trainer_rank.assign(static_cast<size_t>(plan.trainer_world_), 0);
  plan.sent_by_.assign(static_cast<size_t>(plan.trainer_world_), {});
  plan.recv_by_.assign(static_cast<size_t>(plan.engine_world_), {});
  st.predicted_s = 0;
  st.bytes_total = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    Bucket& b = plan.buckets_[i];
    b.start_s = start[i];
    b.end_s = start[i] + jobs[i].dur;
    st.predicted_s = std::max(st.predicted_s, b.end_s);
    st.bytes_per_engine_rank[static_cast<size_t>(b.dst_rank)] += b.bytes;
    st.bytes_per_trainer_rank[static_cast<size_t>(b.src_rank)] += b.bytes;
    st.bytes_total += b.bytes;
  }
  order_by_start(start, scheduler.started(), plan.buckets_, plan.sent_by_, plan.recv_by_);
  st.lower_bound_s = lower_bound(fabric, tx_bytes, rx_bytes);
}

void PlanBuilder::schedule_broadcast(Plan& plan, const Topology& topology) {
  const Fabric fabric(topology, plan.trainer_world_, plan.engine_world_);
  const size_t nres = static_cast<size_t>(fabric.resources());
  std::vector<double> tx_bytes(nres, 0), rx_bytes(nres, 0), tx_free(nres, 0), rx_free(nres, 0);
  PlanStats& st = plan.stats_;
  st.bytes_per_trainer_rank.assign(static_cast<size_t>(plan.trainer_world_), 0);
  plan.sent_by_.assign(static_cast<size_t>(plan.trainer_world_), {});
  std::vector<int32_t> all;
  double engines_free = 0;
  int64_t model_bytes = 0;
  for (Bucket& b : plan.buckets_) {
    // Double buffering: bucket k reuses the root-side buffer of bucket k-2.
    const double gate = b.id >= 2 ? plan.buckets_[static_cast<size_t>(b.id - 2)].end_s : 0;
    double gathered = gate;
    for (const GatherPart& part : plan.gather_parts(b.id)) {
      if (part.src_rank == b.src_rank) continue;  // the root's own data: a local copy
      const Link l = fabric.trainer_to_trainer(part.src_rank, b.src_rank);
      const size_t tx = static_cast<size_t>(l.tx), rx = static_cast<size_t>(l.rx);
      const double s = std::max({tx_free[tx], rx_free[rx], gate});
      tx_free[tx] = rx_free[rx] = s + l.lat + static_cast<double>(part.bytes) / l.bw;
      gathered = std::max(gathered, tx_free[tx]);
      tx_bytes[tx] += static_cast<double>(part.bytes);
      rx_bytes[rx] += static_cast<double>(part.bytes);
      st.bytes_per_trainer_rank[static_cast<size_t>(part.src_rank)] += part.bytes;
    }
    // The broadcast streams through every engine rank (a pipelined chain or
    // tree): the root's link and every engine link carry the bucket once.
    const Link l = fabric.trainer_to_engine(b.src_rank, 0);
    const size_t tx = static_cast<size_t>(l.tx);
    b.start_s = std::max({gathered, tx_free[tx], engines_free});
    b.end_s = b.start_s + l.lat + static_cast<double>(b.bytes) / l.bw;
    tx_free[tx] = engines_free = b.end_s;
    tx_bytes[tx] += static_cast<double>(b.bytes);
    st.bytes_per_trainer_rank[static_cast<size_t>(b.src_rank)] += b.bytes;
    model_bytes += b.bytes;
    plan.sent_by_[static_cast<size_t>(b.src_rank)].push_back(b.id);
    all.push_back(b.id);
  }
  // Only the engine ranks the plan serves receive (elastic replicas).
  st.bytes_per_engine_rank.assign(static_cast<size_t>(plan.engine_world_), 0);
  plan.recv_by_.assign(static_cast<size_t>(plan.engine_world_), {});
  int served = 0;
  for (int g = 0; g < plan.engine_world_; ++g) {
    if (!plan.serves_[static_cast<size_t>(g)]) continue;
    ++served;
    rx_bytes[static_cast<size_t>(fabric.engine_nic(g))] = static_cast<double>(model_bytes);
    st.bytes_per_engine_rank[static_cast<size_t>(g)] = model_bytes;
    plan.recv_by_[static_cast<size_t>(g)] = all;
  }
  st.bytes_total = model_bytes * served;
  // The last bucket still has to reach the far end of the tree.
  const double hops = std::ceil(std::log2(static_cast<double>(served) + 1));
  st.predicted_s = (plan.buckets_.empty() ? 0 : plan.buckets_.back().end_s) +
                   hops * 1e-6 * topology.nic_latency_us;
  st.lower_bound_s = lower_bound(fabric, tx_bytes, rx_bytes);
}

}  // namespace weightsync
