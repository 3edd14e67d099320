#!/usr/bin/env bash
# Builds the safetensors header fuzz target with clang (libFuzzer + ASan +
# UBSan) and runs it for a bounded time over the seed corpus. Exit 77 (CTest
# SKIP_RETURN_CODE) when clang++ cannot build a libFuzzer target here.
#   run_fuzz.sh SOURCE_DIR WORK_DIR [SECONDS]
set -euo pipefail
src="$1"
work="$2"
seconds="${3:-20}"

cxx=""
for c in "${WEIGHTSYNC_FUZZ_CXX:-}" clang++ clang++-14 clang++-15 clang++-16; do
  if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1; then cxx="$c"; break; fi
done
if [ -z "$cxx" ]; then
  echo "SKIP: no clang++ found; the libFuzzer target needs clang (apt-get install clang)"
  exit 77
fi

mkdir -p "$work/corpus"
bin="$work/fuzz_safetensors_header"
# Only the parser and what it needs: the mmap reader and the rest of core stay out.
sources=(
  "$src/tests/fuzz_safetensors/fuzz_safetensors_header.cpp"
  "$src/src/core/safetensors_header.cpp"
  "$src/src/core/dtype.cpp"
  "$src/src/core/error.cpp"
)
newest_src=$(ls -t "${sources[@]}" "$src/include/weightsync/"*.h "$src/src/core/safetensors_json.h" | head -1)
if [ ! -x "$bin" ] || [ "$newest_src" -nt "$bin" ]; then
  echo "building $bin with $cxx"
  if ! "$cxx" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
      -I"$src/include" -I"$src/src/core" "${sources[@]}" -o "$bin.new" 2>"$work/build.log"; then
    if grep -qiE "libfuzzer|fsanitize=fuzzer|cannot find.*fuzzer" "$work/build.log"; then
      cat "$work/build.log"
      echo "SKIP: $cxx cannot link libFuzzer here"
      exit 77
    fi
    cat "$work/build.log"
    echo "FAIL: the fuzz target does not compile"
    exit 1
  fi
  mv "$bin.new" "$bin"
fi

# New inputs go to the work corpus; the seeds in the source tree stay as they are.
cd "$work"
export ASAN_OPTIONS="abort_on_error=1:detect_leaks=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
"$bin" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -max_len=65536 \
  -artifact_prefix="$work/" "$work/corpus" "$src/tests/fuzz_safetensors/corpus"
echo "PASS: no crash in ${seconds}s of fuzzing"
