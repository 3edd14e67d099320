// Internal: the trainer-layout styles share the XTuner-style generation.
#pragma once

#include <weightsync/hf_model.h>
#include <weightsync/load_spec.h>

namespace weightsync {

// Rewrites an XTuner-style layout of `config` into transformers >= 5 style
// (trainer_layout_transformers.cpp).
void to_transformers_style(TrainerLayout& layout, const HfModelConfig& config);

}  // namespace weightsync
