// LoadSpec: where a trainer tensor sits in Hugging Face space (DESIGN.md).
//
// A trainer parameter is a logical global tensor of `global_shape`, the
// concatenation of its `hf_keys` along `fused_dim` (each key an equal extent
// of origin_shape[fused_dim]); elements outside `origin_shape` are padding and
// belong to no key. `shards` are applied in order, each cutting the extent left
// by the previous ones, with PyTorch's ceil-chunk semantics; interleave F > 1
// splits the extent into w*F runs and rank r holds runs j*w + r. Mesh axes not
// named in `shards` replicate.
//
// Stacked keys (`stack_dim` 0): the HF tensors lack the leading dim; entry i
// of it holds keys [i*F, (i+1)*F) of `hf_keys`, fused along `fused_dim` when
// F > 1. That is how transformers >= 5 holds MoE experts in memory:
// `mlp.experts.gate_up_proj` [E, 2I, H] = per expert e, gate_proj then
// up_proj ([I, H] each) fused on dim 1; `mlp.experts.down_proj` [E, H, I].
//
// Explicit segments (`segments`), where the compact form above cannot say
// where a key sits (Megatron's grouped QKV: per query group, its query heads,
// then its key head, then its value head): each segment puts `hf_box` of one
// key at `param_box` of the global tensor, as engine layouts do. Every key is
// held whole (its segments tile it); elements of the global tensor in no
// segment are padding. An empty list is a param with no HF content at all.
//
// Mirrors (`mirror_of`, with an empty segment list): a param that holds a
// copy of an HF key another param of the layout holds, kept equal to it by
// the trainer (Megatron's copy of tied embeddings on the last pipeline
// stage). It is never a source (the planner and the HF save read the key
// from its holders); `shard` and fill_local_tensor fill it as a param of that
// one key (compact form, tail padding zero).
//
// Pipeline stages (`stage`): a param held only by the ranks whose coordinate
// on one mesh axis is `index`, sharded (shards over other axes) or replicated
// inside that stage. Names are unique per rank, not per layout: stages name
// their layers by local index, so params of different stages of one axis may
// share a name (name + stage identify a LoadSpec).
#pragma once

#include <weightsync/box.h>
#include <weightsync/dtype.h>
#include <weightsync/tensor.h>

#include <nlohmann/json_fwd.hpp>

#include <optional>
#include <string>
#include <vector>

namespace weightsync {

// Named axes with sizes; rank -> coordinates is row-major over the axes in
// order, as torch.arange(world).reshape(shape).
struct Mesh {
  std::vector<std::string> axes;
  std::vector<int64_t> shape;

  int64_t world() const noexcept;
  int axis_index(std::string_view axis) const noexcept;  // -1 when absent
  std::vector<int64_t> coords(int64_t rank) const;
  int64_t rank_of(const std::vector<int64_t>& coords) const;
};

struct ShardSpec {
  int dim = 0;
  std::string axis;
  int64_t interleave = 1;
};

// Segment form: `hf_box` of hf_keys[key] lands in `param_box` of the global
// tensor. param_box may have more dims than hf_box: the extra ones lead and
// have length 1 (as engine Segments, and as the stack entries above).
struct LoadSegment {
  int key = 0;
  Box hf_box;
  Box param_box;

  friend bool operator==(const LoadSegment&, const LoadSegment&) = default;
};

// The one pipeline stage holding a param: coordinate `index` of mesh `axis`.
struct StageSpec {
  std::string axis;
  int64_t index = 0;

  friend bool operator==(const StageSpec&, const StageSpec&) = default;
};

struct LoadSpec {
  std::string name;
  std::vector<std::string> hf_keys;
  std::optional<int> fused_dim;  // a dim of the global tensor
  // Keys stacked along this leading dim of the global tensor (only 0); see above.
  std::optional<int> stack_dim;
  Shape global_shape;
  Shape origin_shape;  // defaults to global_shape
  DType dtype = DType::BF16;
  std::vector<ShardSpec> shards;
  // Segment form (fused_dim and stack_dim then null); see above.
  std::optional<std::vector<LoadSegment>> segments;
  std::optional<StageSpec> stage;        // absent: every rank holds the param
  std::optional<std::string> mirror_of;  // see "Mirrors" above

  // Keys fused along fused_dim in one entry of the stack: all keys when
  // nothing is stacked.
  int64_t keys_per_entry() const;
  // The shape of every HF key's tensor (in hf_keys order). Compact form:
  // origin_shape with the fused dim divided by keys_per_entry(), without the
  // stack dim. Segment form: each key's extent over its segments.
  std::vector<Shape> key_shapes() const;
  // The one shape all keys share (compact form); Errc::invalid_layout naming
  // the param when its segments give keys of different shapes.
  Shape hf_key_shape() const;
  // True when some element of the global tensor belongs to no key (tail
  // padding, or parts no segment covers): such elements are zero-filled.
  bool has_padding() const;
};

// A piece of a rank's local tensor: `local_box` of the local tensor holds
// `hf_box` of the tensor stored under hf_keys[key]. When the spec stacks keys,
// local_box has one more, leading, dim of length 1 (the stack entry).
struct Piece {
  int key = 0;
  Box hf_box;
  Box local_box;

  friend bool operator==(const Piece&, const Piece&) = default;
};

// The box of a rank's local tensor holding `hf_sub` (inside the piece's
// `hf_box`), and the reverse: the HF box held by `local_sub` (inside the
// piece's `local_box`). They handle the leading stack dim.
Box local_sub_box(const Box& piece_hf, const Box& piece_local, const Box& hf_sub);
Box hf_sub_box(const Box& piece_hf, const Box& piece_local, const Box& local_sub);

struct TrainerLayout {
  Mesh mesh;
  std::vector<LoadSpec> params;

  // Parse and validate; Errc::invalid_layout (or Errc::format for JSON of the
  // wrong shape) naming the parameter and the field.
  static TrainerLayout from_json(const nlohmann::json& j);
  static TrainerLayout load(const std::string& path);
  nlohmann::json to_json() const;
  // Every rule of DESIGN.md: known axes, dims in range, an axis used once per
  // param, interleave dividing its extent, origin <= global, fused keys
  // dividing the fused extent, names unique on every rank, keys unique,
  // dtypes; segments inside the param and tiling their keys; stages on a mesh
  // axis no shard of the param uses.
  void validate() const;
  // Indices of the params `rank` holds (every param without a stage, and
  // those of its stages), in layout order.
  std::vector<size_t> rank_params(int64_t rank) const;
};

// True when `rank` holds `spec`: it has no stage, or the rank's coordinate on
// the stage axis is the stage index.
bool holds(const LoadSpec& spec, const Mesh& mesh, int64_t rank);

// The local shape of `spec` on `rank` (dims may be 0); Errc::invalid_argument
// naming the param, its stage and the rank when the rank does not hold it.
Shape local_shape(const LoadSpec& spec, const Mesh& mesh, int64_t rank);
// The pieces of `spec` held by `rank`: they tile the non-padding part of the
// local tensor exactly; padding elements are in no piece. None on a rank of
// another stage.
std::vector<Piece> local_pieces(const LoadSpec& spec, const Mesh& mesh, int64_t rank);

class Checkpoint;

// Checks that `checkpoint` holds every key of `layout` with the shape
// (hf_key_shape) and dtype its LoadSpec expects: Errc::not_found naming a
// missing key, Errc::mismatch naming the key and both shapes or dtypes.
void check_checkpoint(const Checkpoint& checkpoint, const TrainerLayout& layout);

// Fills `dst` (contiguous host memory of local_shape(spec, mesh, rank) in
// spec.dtype) with the rank's local tensor read from `checkpoint`; padding is
// zero.
void fill_local_tensor(const Checkpoint& checkpoint, const LoadSpec& spec, const Mesh& mesh,
                       int64_t rank, const TensorView& dst);

// `weightsync shard`: writes rank `rank`'s local tensors (the params it
// holds), each under its LoadSpec name and dtype, to the safetensors file
// `out_path`. Streams through
// one buffer of at most about `buffer_bytes` (never the whole rank in memory);
// checks the checkpoint first (check_checkpoint) and the rank
// (Errc::invalid_argument when out of range).
void write_rank_shard(const Checkpoint& checkpoint, const TrainerLayout& layout, int64_t rank,
                      const std::string& out_path, std::size_t buffer_bytes = 64u << 20);

}  // namespace weightsync
