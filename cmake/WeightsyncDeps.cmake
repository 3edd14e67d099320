# Finds the dependencies. WEIGHTSYNC_WITH_X is ON / OFF / AUTO; AUTO means "on when found".
find_package(Threads REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
# Boost's own CMake package (Debian's libboost1.74-dev ships it): CMake 4
# removed the FindBoost module.
find_package(Boost 1.74 CONFIG REQUIRED)

function(_ws_want opt out)
  if("${${opt}}" STREQUAL "OFF")
    set(${out} OFF PARENT_SCOPE)
  else()
    set(${out} ON PARENT_SCOPE)
  endif()
endfunction()

set(WEIGHTSYNC_HAVE_UCX OFF)
_ws_want(WEIGHTSYNC_WITH_UCX _want_ucx)
if(_want_ucx)
  find_package(ucx CONFIG QUIET)
  if(ucx_FOUND)
    set(WEIGHTSYNC_HAVE_UCX ON)
  elseif(WEIGHTSYNC_WITH_UCX STREQUAL "ON")
    message(FATAL_ERROR "WEIGHTSYNC_WITH_UCX=ON but UCX was not found (apt-get install libucx-dev)")
  endif()
endif()

set(WEIGHTSYNC_HAVE_PROMETHEUS OFF)
_ws_want(WEIGHTSYNC_WITH_PROMETHEUS _want_prometheus)
if(_want_prometheus)
  find_package(prometheus-cpp CONFIG QUIET)
  if(prometheus-cpp_FOUND AND TARGET prometheus-cpp::pull)
    set(WEIGHTSYNC_HAVE_PROMETHEUS ON)
  elseif(WEIGHTSYNC_WITH_PROMETHEUS STREQUAL "ON")
    message(FATAL_ERROR
      "WEIGHTSYNC_WITH_PROMETHEUS=ON but prometheus-cpp was not found (apt-get install prometheus-cpp-dev)")
  endif()
endif()

set(WEIGHTSYNC_HAVE_CUDA OFF)
_ws_want(WEIGHTSYNC_WITH_CUDA _want_cuda)
if(_want_cuda)
  if(NOT CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  # The copy kernel needs nvcc: CUDA counts as found only with its compiler.
  # enable_language runs here, at the top directory's scope (this file is
  # include()d from it), as CMake requires for a language that targets in
  # several directories link.
  if(CUDAToolkit_FOUND)
    if(NOT CMAKE_CUDA_COMPILER AND CUDAToolkit_NVCC_EXECUTABLE AND EXISTS "${CUDAToolkit_NVCC_EXECUTABLE}")
      set(CMAKE_CUDA_COMPILER "${CUDAToolkit_NVCC_EXECUTABLE}")
    endif()
    include(CheckLanguage)
    check_language(CUDA)
  endif()
  # The CUDA runtime is linked statically (CUDA::cudart_static) into every
  # target: a process that also loads PyTorch, which brings its own, newer
  # libcudart, must not get a second shared one of another version. The
  # driver (libcuda.so.1) stays a system library that the runtime loads.
  if(CUDAToolkit_FOUND AND CMAKE_CUDA_COMPILER AND TARGET CUDA::cudart_static)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Ampere and Hopper machine code, plus Hopper PTX for newer GPUs.
      set(CMAKE_CUDA_ARCHITECTURES 80-real 90)
    endif()
    # Also what nvcc-linked CUDA targets get (the default of the targets'
    # CUDA_RUNTIME_LIBRARY); set before enable_language, which reads it.
    set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
    enable_language(CUDA)
    set(WEIGHTSYNC_HAVE_CUDA ON)
  elseif(WEIGHTSYNC_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "WEIGHTSYNC_WITH_CUDA=ON but the CUDA toolkit, nvcc or the static "
                        "CUDA runtime (libcudart_static.a) was not found")
  endif()
endif()

set(WEIGHTSYNC_HAVE_NCCL OFF)
_ws_want(WEIGHTSYNC_WITH_NCCL _want_nccl)
if(_want_nccl AND WEIGHTSYNC_HAVE_CUDA)
  # Only the header: the transport loads libnccl.so.2 at run time (dlopen),
  # reusing one already in the process (PyTorch's), so that weightsync never
  # brings a second NCCL of another version (src/transport/nccl/nccl_library.h).
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  if(NCCL_INCLUDE_DIR)
    set(WEIGHTSYNC_HAVE_NCCL ON)
  endif()
endif()
if(WEIGHTSYNC_WITH_NCCL STREQUAL "ON" AND NOT WEIGHTSYNC_HAVE_NCCL)
  message(FATAL_ERROR "WEIGHTSYNC_WITH_NCCL=ON but nccl.h (or CUDA) was not found")
endif()
