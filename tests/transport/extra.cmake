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

# UcxWheel.TransportSuite: the UCX cases of ws_transport_tests (conformance,
# UcxSelf, UcxEnvironment, UcxLibrary) again, with PyPI's libucx-cu13 (UCX
# 1.22, built with CUDA) found first through LD_LIBRARY_PATH: the binary is
# built against the system UCX and must run unchanged with that one (docs/
# transports.md, "UCX with CUDA"). `bash run.sh test` installs the wheel at
# WEIGHTSYNC_UCX_WHEEL_LIB; without it the test is skipped, saying so.
set(WEIGHTSYNC_UCX_WHEEL_LIB "${PROJECT_SOURCE_DIR}/.venv/opt/libucx-cu13/libucx/lib"
  CACHE PATH "lib directory of a libucx-cu13 wheel for UcxWheel.TransportSuite")
add_test(NAME UcxWheel.TransportSuite
  COMMAND bash -c [=[
if [ ! -e "$1/libucp.so.0" ]; then
  echo "skipped: no libucx-cu13 at $1 (bash run.sh test installs it)"; exit 77
fi
LD_LIBRARY_PATH="$1" WEIGHTSYNC_TEST_UCX_DIR="$1" exec "$2" --gtest_filter='*ucx*:*Ucx*'
]=] _ "${WEIGHTSYNC_UCX_WHEEL_LIB}" $<TARGET_FILE:ws_transport_tests>)
set_tests_properties(UcxWheel.TransportSuite PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
