# Independent Python cross-checks against PyTorch semantics (Debian's
# python3-torch under /usr/bin/python3); skipped, visibly, without torch.
find_program(WEIGHTSYNC_SYSTEM_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(WEIGHTSYNC_SYSTEM_PYTHON)
  add_test(NAME pycheck.shard_vs_torch
           COMMAND ${WEIGHTSYNC_SYSTEM_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/shard_check.py
                   $<TARGET_FILE:weightsync_cli> --cases 60)
  set_tests_properties(pycheck.shard_vs_torch PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
if(WEIGHTSYNC_SYSTEM_PYTHON)
  add_test(NAME pycheck.materialize_vs_vllm_semantics
           COMMAND ${WEIGHTSYNC_SYSTEM_PYTHON} ${CMAKE_CURRENT_LIST_DIR}/materialize_check.py
                   $<TARGET_FILE:weightsync_cli> ${PROJECT_SOURCE_DIR})
  set_tests_properties(pycheck.materialize_vs_vllm_semantics PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
