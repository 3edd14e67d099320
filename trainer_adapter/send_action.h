// What a trainer rank does with one bucket each step (SendPipeline compiles
// them once from the plan): send it to its engine rank (p2p), gather its
// parts and broadcast it (a broadcast root), or send its part to the root (a
// holder). Delta sync (delta_sender.h) and lent buckets (loan_writer.h) each
// add their fields.
#pragma once

#include <weightsync/backend/transport.h>
#include <weightsync/plan.h>
#include "pipeline/wire.h"

#include "core/copy_program.h"
#include "core/fp8.h"
#include "pipeline/delta_frame.h"

#include <cstdint>
#include <vector>

namespace weightsync::trainer {

struct SendAction {
  enum class Kind { p2p, root, holder };
  Kind kind = Kind::p2p;
  int32_t bucket = 0;
  int dst_engine = -1;  // p2p: global engine rank
  int root = -1;        // the bucket's sender (broadcast: the root trainer rank)
  int64_t bytes = 0;    // what goes on the wire, without trailer (holder: its part)
  int64_t base = 0;     // bucket offset of this rank's packing (holder: part offset)
  // This rank's items packed into the slot (p2p: the packed fragments'
  // items): sources are tensor addresses, destinations slot offsets.
  CopyProgram pack;
  // p2p, FP8 engines: the items this rank quantizes (Copy::fp8), from the
  // tensors into the slot; run before the bucket's fragments are sent.
  fp8::QuantProgram quant;
  // p2p; a packed fragment's first_op/num_ops index pack.runs().
  std::vector<FragmentRoute> fragments;
  int64_t packed_bytes = 0;       // p2p: slot bytes the packed fragments use
  std::vector<GatherPart> parts;  // root: the other holders' parts to receive
  // Delta sync (WireOptions::delta, p2p): the bucket's items as the codec
  // sees them, and its DeltaBase (DeltaSender's bases).
  std::vector<pipeline::FrameItem> items;
  int delta_base = -1;
  // Per item: its bytes in place in the tensor (diffed from there), or
  // nullptr (packed by `pack`/`quant` into the slot); and the pack of the
  // in-place ones, for a whole frame.
  std::vector<const char*> in_place;
  CopyProgram pack_in_place;
  // A whole step of host tensors: the frame's header alone, then the
  // bucket's `fragments` as without delta, packed by these (the frame's
  // layout is `pack`/`quant`'s).
  CopyProgram whole_pack;
  fp8::QuantProgram whole_quant;
  // Broadcast roots: what each engine template reads of the bucket (the
  // delta frame's digests).
  std::vector<std::vector<pipeline::ReadBox>> reads;
  // Lent buckets (pipeline/wire.h): whether this one may be, its items, and
  // their copy straight into the engine's params where the loan maps them
  // (compiled when the addresses change).
  bool lendable = false;
  std::vector<Copy> lend_items;
  CopyProgram lent;
};

// The actions of `rank` in the plan's order (publisher_pipeline.h), with
// their buckets' sizes, engine ranks and gather parts; their programs are
// the pipeline's to compile.
std::vector<SendAction> ordered_actions(const Plan& plan, int rank);

// A p2p action's a.fragments and a.packed_bytes, and the pack of the
// packed fragments into `pack` and `quant` (the caps are the transport's:
// which memory a fragment may be sent from).
void compile_fragments(SendAction& a, const Plan& plan, const std::vector<TensorView>& tensors,
                       const WireOptions& wire, const Capabilities& caps, CopyProgram& pack,
                       fp8::QuantProgram& quant);

// Appends the quantization of one plan item its sender quantizes (Copy::fp8):
// `c.src_box` of `tensor` into FP8 codes row-major at bucket offset c.offset
// - base, then its blocks' F32 scales row-major.
void add_quant(fp8::QuantProgram& program, const Copy& c, const TensorView& tensor, int64_t base);

}  // namespace weightsync::trainer
