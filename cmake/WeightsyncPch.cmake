# Precompiled headers: the standard library, nlohmann/json and (in the tests)
# GoogleTest are parsed once per target instead of once per source file. Only
# third-party and standard headers go in, never weightsync's own, so that an
# edit to a project header rebuilds what it did before. Only C++ sources use
# them: the CUDA kernels (nvcc) and any C source are left as they are.
#
# On by default with Clang (the sanitizer legs of .ci/sanitizers.sh), where
# they save time; off with GCC, where loading the large precompiled header
# costs about what it saves (measured per file at -O2 -g: from -1.4 s to
# +1 s), and off under a compiler launcher (ccache does not cache
# compilations that use a precompiled header unless configured for it).
# -DWEIGHTSYNC_PCH=ON|OFF decides. The builds without them (GCC's) are also
# the ones that catch a source file that forgets an #include which the
# precompiled header supplied.
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang" AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(_ws_pch_default ON)
else()
  set(_ws_pch_default OFF)
endif()
option(WEIGHTSYNC_PCH "Use precompiled headers for the C++ targets" ${_ws_pch_default})

# What most of the sources (and the public headers) include.
set(WEIGHTSYNC_PCH_HEADERS
  <algorithm> <array> <atomic> <chrono> <cstddef> <cstdint> <cstdio> <cstdlib> <cstring>
  <filesystem> <fstream> <functional> <iostream> <limits> <map> <memory> <mutex> <optional>
  <set> <sstream> <string> <string_view> <thread> <unordered_map> <utility> <vector>
  <nlohmann/json.hpp>)

# weightsync_precompile_headers(TARGET [REUSE_FROM OTHER] [HEADERS h...]):
# TARGET's C++ sources get the headers above plus HEADERS; with REUSE_FROM,
# TARGET uses OTHER's precompiled header instead (same compiler flags needed:
# only targets of the same kind, e.g. two test executables).
function(weightsync_precompile_headers target)
  if(NOT WEIGHTSYNC_PCH)
    return()
  endif()
  cmake_parse_arguments(ARG "" "REUSE_FROM" "HEADERS" ${ARGN})
  if(ARG_REUSE_FROM)
    target_precompile_headers(${target} REUSE_FROM ${ARG_REUSE_FROM})
    return()
  endif()
  set(_headers)
  foreach(_h IN LISTS WEIGHTSYNC_PCH_HEADERS ARG_HEADERS)
    list(APPEND _headers "$<$<COMPILE_LANGUAGE:CXX>:${_h}>")
  endforeach()
  target_precompile_headers(${target} PRIVATE ${_headers})
endfunction()
