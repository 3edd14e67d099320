# Independent Python cross-checks against PyTorch semantics, under
# WEIGHTSYNC_TEST_PYTHON (tests/CMakeLists.txt); skipped, visibly, without torch.
set(_ws_pycheck_python "${WEIGHTSYNC_TEST_PYTHON}")
if(_ws_pycheck_python)
  add_test(NAME pycheck.shard_vs_torch
           COMMAND ${_ws_pycheck_python} ${CMAKE_CURRENT_LIST_DIR}/shard_check.py
                   $<TARGET_FILE:weightsync_cli> --cases 60)
  set_tests_properties(pycheck.shard_vs_torch PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
if(_ws_pycheck_python)
  add_test(NAME pycheck.materialize_vs_vllm_semantics
           COMMAND ${_ws_pycheck_python} ${CMAKE_CURRENT_LIST_DIR}/materialize_check.py
                   $<TARGET_FILE:weightsync_cli> ${PROJECT_SOURCE_DIR})
  set_tests_properties(pycheck.materialize_vs_vllm_semantics PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
if(_ws_pycheck_python)
  add_test(NAME pycheck.fp8_vs_ml_dtypes
           COMMAND ${_ws_pycheck_python} ${CMAKE_CURRENT_LIST_DIR}/fp8_check.py
                   $<TARGET_FILE:weightsync_cli> ${PROJECT_SOURCE_DIR})
  set_tests_properties(pycheck.fp8_vs_ml_dtypes PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
