// Hugging Face checkpoints from sharded trainers (DESIGN.md "HF checkpoints:
// save and load"): which file holds which key and which trainer rank writes
// it, and how a rank fills its local shards from a checkpoint.
//
// A checkpoint directory holds `model-0000i-of-0000N.safetensors` files and
// `model.safetensors.index.json` ({"metadata": {"total_size": N},
// "weight_map": {key: file}}), as transformers' save_pretrained writes them.
// Keys follow the trainer layout's order (params in order, each param's
// hf_keys in order) and are cut into files of at most max_file_bytes (a key
// larger than that gets a file of its own). Publisher::save_hf writes one
// (publisher.h); load_local_tensors reads any checkpoint weightsync can open.
#pragma once

#include <weightsync/load_spec.h>
#include <weightsync/tensor.h>

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace weightsync {

class Checkpoint;

// save_pretrained's default shard size, "5GB" (decimal, as transformers reads it).
inline constexpr int64_t kDefaultMaxFileBytes = 5'000'000'000;
inline constexpr std::string_view kHfIndexName = "model.safetensors.index.json";

// "model-00002-of-00005.safetensors" for index 1 (counting from 0) of 5.
std::string hf_file_name(int index, int count);

struct HfKey {
  std::string name;
  Shape shape;
  DType dtype = DType::BF16;
  int64_t bytes = 0;
  int param = 0;  // index into TrainerLayout::params
  int file = 0;   // index into HfFileLayout::files
};

struct HfFile {
  std::string name;                 // hf_file_name(index, count)
  int writer = 0;                   // the trainer rank that writes it
  int first_key = 0, num_keys = 0;  // keys [first_key, first_key + num_keys)
  int64_t bytes = 0;                // payload (the tensors' bytes)
};

// Where every key of a trainer layout goes in a checkpoint, and who writes it.
struct HfFileLayout {
  std::vector<HfKey> keys;    // checkpoint order
  std::vector<HfFile> files;  // file order
  int writers = 1;            // the trainer world

  int64_t total_bytes() const noexcept;
  // The files trainer rank `rank` writes, ascending.
  std::vector<int> files_of(int rank) const;
  // model.safetensors.index.json: metadata.total_size and the weight_map.
  nlohmann::json index_json() const;
};

// The file layout of `layout`'s keys, deterministic (every rank computes the
// same): keys in order cut at `max_file_bytes` (> 0, Errc::invalid_argument
// otherwise). Files go to trainer ranks balanced by bytes: first the files
// some rank holds keys of whole (such a key is written from the rank's own
// shard: no bytes move), then the others, largest first in each pass; each
// to the rank holding most of it whole among those it fits (their load stays
// within 10% above an even share), else the least loaded, then the lowest.
HfFileLayout make_hf_file_layout(const TrainerLayout& layout,
                                 int64_t max_file_bytes = kDefaultMaxFileBytes);

// Checks that `checkpoint` holds every key of `layout` with the dtype and
// shape its LoadSpec expects. Errors name the key, trainer rank `rank`, the
// file, and what was expected: Errc::not_found for a missing key,
// Errc::mismatch for a shape or dtype.
void check_hf_checkpoint(const Checkpoint& checkpoint, const TrainerLayout& layout, int64_t rank);

struct LoadReport {
  uint64_t bytes = 0;      // bytes copied out of the files
  std::size_t pieces = 0;  // pieces read
  std::size_t files = 0;   // files touched
  double seconds = 0;
};

// Fills rank `rank`'s local tensors (indexed like layout.params, each of its
// local shape and dtype; any strides; host memory, or CUDA with a CUDA build)
// from the checkpoint: one pass over the rank's pieces in file order (file,
// then offset), each copied straight from the mapped file; fused and stacked
// keys as the LoadSpecs say; padding elements zero. Checks the checkpoint
// first (check_hf_checkpoint) and each tensor (Errc::mismatch naming the
// param and the rank).
LoadReport load_local_tensors(const Checkpoint& checkpoint, const TrainerLayout& layout,
                              int64_t rank, const std::vector<TensorView>& tensors);

}  // namespace weightsync
