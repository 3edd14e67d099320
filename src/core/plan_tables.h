// The planner's internal tables (plan.h declares them): the trainer pieces
// and engine segments that plan items index. Not installed.
#pragma once

#include <weightsync/plan.h>

#include <cstdint>

namespace weightsync {

struct Plan::PieceRef {
  int32_t rank = 0, param = 0, key = 0;
  Box hf_box, local_box;
};

struct Plan::SegmentRef {
  int32_t tp_rank = 0, param = 0, key = 0;  // tp_rank: the engine template
  bool transpose = false;
  bool fp8_wire = false;  // quantized by the sender (see Copy::fp8)
  ScaleFormat fp8_format = ScaleFormat::fp32;
  int32_t scale_param = -1;  // the FP8 param's scale param, when fp8_wire
  Box hf_box, param_box;
};

}  // namespace weightsync
