# Fuzzes the control plane's frame decoder, message validator and coordinator
# state machine (tests/fuzz_control/run_fuzz.sh builds it with clang++).
add_test(NAME fuzz_control
  COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/run_fuzz.sh ${PROJECT_SOURCE_DIR}
          ${CMAKE_CURRENT_BINARY_DIR}/fuzz_control 20)
set_tests_properties(fuzz_control PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 900 LABELS fuzz)
