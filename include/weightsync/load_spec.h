// LoadSpec: where a trainer tensor sits in Hugging Face space (DESIGN.md).
//
// A trainer parameter is a logical global tensor of `global_shape`, the
// concatenation of its `hf_keys` along `fused_dim` (each key an equal extent
// of origin_shape[fused_dim]); elements outside `origin_shape` are padding and
// belong to no key. `shards` are applied in order, each cutting the extent left
// by the previous ones, with PyTorch's ceil-chunk semantics; interleave F > 1
// splits the extent into w*F runs and rank r holds runs j*w + r. Mesh axes not
// named in `shards` replicate.
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

struct LoadSpec {
  std::string name;
  std::vector<std::string> hf_keys;
  std::optional<int> fused_dim;
  Shape global_shape;
  Shape origin_shape;  // defaults to global_shape
  DType dtype = DType::BF16;
  std::vector<ShardSpec> shards;

  // The shape of each HF key's tensor: origin_shape with the fused dim divided
  // by the number of keys.
  Shape hf_key_shape() const;
};

// A piece of a rank's local tensor: `local_box` of the local tensor holds
// `hf_box` of the tensor stored under hf_keys[key].
struct Piece {
  int key = 0;
  Box hf_box;
  Box local_box;

  friend bool operator==(const Piece&, const Piece&) = default;
};

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
  // dividing the fused extent, unique names and keys, dtypes.
  void validate() const;
};

// The local shape of `spec` on `rank` (dims may be 0).
Shape local_shape(const LoadSpec& spec, const Mesh& mesh, int64_t rank);
// The pieces of `spec` held by `rank`: they tile the non-padding part of the
// local tensor exactly; padding elements are in no piece.
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

// `weightsync shard`: writes rank `rank`'s local tensors, each under its
// LoadSpec name and dtype, to the safetensors file `out_path`. Streams through
// one buffer of at most about `buffer_bytes` (never the whole rank in memory);
// checks the checkpoint first (check_checkpoint) and the rank
// (Errc::invalid_argument when out of range).
void write_rank_shard(const Checkpoint& checkpoint, const TrainerLayout& layout, int64_t rank,
                      const std::string& out_path, std::size_t buffer_bytes = 64u << 20);

}  // namespace weightsync
