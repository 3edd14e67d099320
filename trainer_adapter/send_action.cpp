#include "send_action.h"

#include <weightsync/error.h>

#include "pipeline/item_copies.h"

namespace weightsync::trainer {
namespace {

// The bucket's sizes, engine rank and (broadcast) this rank's part of it or
// the other holders' parts.
void describe_bucket(SendAction& a, const Plan& plan, int rank) {
  const Bucket& bucket = plan.buckets()[static_cast<size_t>(a.bucket)];
  a.bytes = bucket.bytes;
  a.dst_engine = bucket.dst_rank;
  a.root = bucket.src_rank;
  if (plan.mode() != PlanMode::broadcast) return;
  for (const GatherPart& part : plan.gather_parts(a.bucket)) {
    if (a.kind == SendAction::Kind::holder && part.src_rank == rank) {
      a.base = part.offset;
      a.bytes = part.bytes;
    } else if (a.kind == SendAction::Kind::root && part.src_rank != rank) {
      a.parts.push_back(part);
    }
  }
}

}  // namespace

std::vector<SendAction> ordered_actions(const Plan& plan, int rank) {
  std::vector<SendAction> out;
  const bool broadcast = plan.mode() == PlanMode::broadcast;
  std::vector<int32_t> holder;
  if (broadcast)
    for (int32_t b : plan.buckets_gathered_from(rank)) holder.push_back(b);
  const auto& roots = plan.buckets_sent_by(rank);
  size_t r = 0, h = 0;
  while (r < roots.size() || h < holder.size()) {
    SendAction a;
    if (h == holder.size() || (r < roots.size() && roots[r] < holder[h])) {
      a.kind = broadcast ? SendAction::Kind::root : SendAction::Kind::p2p;
      a.bucket = roots[r++];
    } else {
      a.kind = SendAction::Kind::holder;
      a.bucket = holder[h++];
    }
    describe_bucket(a, plan, rank);
    out.push_back(std::move(a));
  }
  return out;
}

void add_quant(fp8::QuantProgram& program, const Copy& c, const TensorView& tensor, int64_t base) {
  const size_t n = c.src_box.rank(), h = c.hf_box.rank();
  if (!same_lengths_but_leading_ones(c.src_box.lengths, c.hf_box.lengths) || h != 2)
    fail(Errc::internal, "plan item of trainer param ", c.src_param, ": source box ",
         box_str(c.src_box), " and HF box ", box_str(c.hf_box), " differ in size");
  if (tensor.dtype != c.dtype)
    fail(Errc::invalid_argument, "trainer param ", c.src_param, " is ", dtype_name(tensor.dtype),
         ", its layout says ", dtype_name(c.dtype));
  const Shape strides = tensor.effective_strides();
  const auto item = static_cast<int64_t>(itemsize(tensor.dtype));
  int64_t first = 0;
  for (size_t d = 0; d < n; ++d) first += c.src_box.offsets[d] * strides[d];
  fp8::Region g;
  g.rows = c.hf_box.lengths[0];
  g.cols = c.hf_box.lengths[1];
  g.src = static_cast<int64_t>(pipeline::addr(tensor.data)) + first * item;
  g.src_rs = n >= 2 ? strides[n - 2] : 0;
  g.src_cs = strides[n - 1];
  g.dst = c.offset - base;
  g.dst_rs = g.cols;
  g.dst_relative = true;
  g.scale = g.dst + g.rows * g.cols;
  g.scale_rs = (g.cols + fp8::kBlock - 1) / fp8::kBlock;
  if (g.rows > 0 && g.cols > 0) fp8::add_region(program, g, tensor.dtype, c.fp8_format);
}

void compile_fragments(SendAction& a, const Plan& plan, const std::vector<TensorView>& tensors,
                       const WireOptions& wire, const Capabilities& caps, CopyProgram& pack,
                       fp8::QuantProgram& quant) {
  auto tensor = [&](const Copy& c) -> const TensorView& {
    return tensors.at(static_cast<size_t>(c.src_param));
  };
  std::vector<uint32_t> first_run;  // of each packed item, in pack.runs()
  a.fragments = route_fragments(
      plan, a.bucket, wire.direct_min_bytes,
      [&](const Copy& c) {
        return same_lengths_but_leading_ones(c.src_box.lengths, c.hf_box.lengths)
                   ? direct_route(tensor(c), c.src_box, caps, wire)
                   : FragmentRoute{};
      },
      [&](const Copy& c, int64_t shift) {
        first_run.push_back(static_cast<uint32_t>(pack.size()));
        if (c.fp8)
          add_quant(quant, c, tensor(c), -shift);
        else
          pipeline::add_pack(pack, c, tensor(c), -shift);
      },
      a.packed_bytes);
  first_run.push_back(static_cast<uint32_t>(pack.size()));
  // Items -> runs: a packed fragment runs its items' runs of the program.
  // Its checksum is summed inside them unless an item is quantized (its
  // bytes are written by `quant`, not by runs).
  for (FragmentRoute& f : a.fragments) {
    if (f.direct) continue;
    const uint32_t begin = first_run[f.first_op], end = first_run[f.first_op + f.num_ops];
    f.first_op = begin;
    f.num_ops = end - begin;
    f.fused = runs_bytes(pack, begin, end - begin) == f.bytes;
  }
}

}  // namespace weightsync::trainer
