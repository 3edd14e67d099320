# The safetensors header fuzz run: compiled with clang++ by run_fuzz.sh (the
# main build may use g++), then fuzzed for a bounded time. Skipped, visibly,
# where clang++ is missing.
find_program(WEIGHTSYNC_BASH bash)
if(WEIGHTSYNC_BASH)
  add_test(NAME fuzz_safetensors_header
    COMMAND ${WEIGHTSYNC_BASH} ${CMAKE_CURRENT_LIST_DIR}/run_fuzz.sh
            ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR}/fuzz_safetensors 20)
  set_tests_properties(fuzz_safetensors_header PROPERTIES
    SKIP_RETURN_CODE 77 TIMEOUT 600 LABELS fuzz)
endif()
