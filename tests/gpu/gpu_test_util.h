// Shared by the GPU tests (CTest label `gpu`): they skip, visibly and with the
// reason, where no GPU can be used, and never count as passes there.
#pragma once

#include <weightsync/backend/transport.h>

#include "core/cuda/gpu.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>

namespace weightsync::gpu_test {

#define REQUIRE_GPU()                                                        \
  do {                                                                       \
    if (::weightsync::gpu::device_count() == 0)                              \
      GTEST_SKIP() << "no GPU: " << ::weightsync::gpu::unavailable_reason(); \
  } while (0)

#define REQUIRE_GPUS(n)                                                                       \
  do {                                                                                        \
    REQUIRE_GPU();                                                                            \
    if (::weightsync::gpu::device_count() < (n))                                              \
      GTEST_SKIP() << "NCCL refuses two ranks of one communicator on one GPU "                \
                      "(\"Duplicate GPU detected\"): this test needs "                        \
                   << (n) << " GPUs, this machine has " << ::weightsync::gpu::device_count(); \
  } while (0)

#define REQUIRE_TRANSPORT(name)                                        \
  do {                                                                 \
    const auto _built = ::weightsync::transport_names();               \
    if (std::find(_built.begin(), _built.end(), name) == _built.end()) \
      GTEST_SKIP() << "transport '" << name << "' is not built in";    \
  } while (0)

}  // namespace weightsync::gpu_test
