// Filling a mirror (LoadSpec::mirror_of): the compact spec of the one key it
// copies, for the code that fills local tensors (shard, HF load).
#pragma once

#include <weightsync/load_spec.h>

namespace weightsync::detail {

// `spec` itself, or for a mirror a compact spec of its key (same name,
// global shape, dtype, shards and stage; `key_shape` as the origin, the rest
// padding). Errc::mismatch naming the param when the key does not fit.
LoadSpec mirror_content(const LoadSpec& spec, const Shape& key_shape);

}  // namespace weightsync::detail
