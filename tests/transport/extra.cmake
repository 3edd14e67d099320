# The GPU cases of ws_transport_tests (cuda_ipc's conformance and scenario
# cases, CudaIpc.*) carry the CTest label `gpu`, so that `ctest -L gpu` runs
# them on a GPU machine; elsewhere they report as skipped, with the reason.
# Their names exist only once gtest discovery has run (at build time), so the
# label is set by a script that CTest reads after the discovered tests.
set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES
  ${CMAKE_CURRENT_LIST_DIR}/label_gpu_tests.cmake)

# nccl_library_test.cpp tests the NCCL loader, whose header needs nccl.h.
if(WEIGHTSYNC_HAVE_NCCL)
  target_include_directories(ws_transport_tests SYSTEM PRIVATE ${NCCL_INCLUDE_DIR})
endif()
