# Read by CTest (see extra.cmake): labels the GPU cases of ws_transport_tests
# (cuda_ipc's, and NCCL's conformance cases: NCCL needs a GPU per rank).
# gtest discovery lists them in ws_transport_tests_TESTS; parameterized names
# end in "/<param>" or "/<param>  # GetParam() = ...".
foreach(_test IN LISTS ws_transport_tests_TESTS)
  if(_test MATCHES "/cuda_ipc( |$)" OR _test MATCHES "^CudaIpc\\." OR _test MATCHES "/nccl( |$)")
    set_tests_properties("${_test}" PROPERTIES LABELS gpu)
  endif()
endforeach()
