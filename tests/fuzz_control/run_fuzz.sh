#!/usr/bin/env bash
# Builds the control-plane fuzz target with clang++ (libFuzzer + ASan + UBSan)
# straight from its sources and runs it for a bounded time on a copy of the
# seed corpus. Exit 77 (CTest: skipped) when clang++ or libFuzzer is missing.
#   run_fuzz.sh SOURCE_DIR WORK_DIR [SECONDS]
set -euo pipefail
src="$1"
work="$2"
seconds="${3:-20}"
cxx="${CLANGXX:-clang++}"

if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "SKIP: $cxx not found; the control fuzz target needs clang's libFuzzer"
  exit 77
fi
mkdir -p "$work/corpus"
probe="$work/probe.cpp"
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' >"$probe"
if ! "$cxx" -fsanitize=fuzzer "$probe" -o "$work/probe" >/dev/null 2>&1; then
  echo "SKIP: $cxx cannot link -fsanitize=fuzzer (libFuzzer runtime missing)"
  exit 77
fi

"$cxx" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$src/include" -I"$src/src" \
  "$src/tests/fuzz_control/fuzz_control.cpp" \
  "$src/src/control/protocol.cpp" "$src/src/control/events.cpp" \
  "$src/src/control/coordinator_state.cpp" "$src/src/control/coordinator_steps.cpp" \
  "$src/src/control/coordinator_status.cpp" "$src/src/control/metrics.cpp" \
  "$src/src/core/error.cpp" \
  -o "$work/fuzz_control"

cp "$src"/tests/fuzz_control/corpus/* "$work/corpus/"
# -max_len bounds one input; the coordinator's own limits bound the rest.
"$work/fuzz_control" -max_total_time="$seconds" -max_len=8192 -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 "$work/corpus"
