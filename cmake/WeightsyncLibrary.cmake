# weightsync_add_library(NAME DIR [DEPS ...]): a static library from every .cpp
# in DIR (non-recursive; subfolders add their own sources with target_sources),
# or an INTERFACE library while DIR has none yet.
function(weightsync_add_library name dir)
  cmake_parse_arguments(ARG "" "" "DEPS" ${ARGN})
  file(GLOB _srcs CONFIGURE_DEPENDS ${dir}/*.cpp)
  if(_srcs)
    add_library(${name} STATIC ${_srcs})
    target_include_directories(${name} PUBLIC
      $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
      $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
      PRIVATE ${PROJECT_SOURCE_DIR}/src ${dir})
    target_link_libraries(${name} PUBLIC weightsync_options ${ARG_DEPS})
    weightsync_precompile_headers(${name})
  else()
    add_library(${name} INTERFACE)
    target_include_directories(${name} INTERFACE
      $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
      $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
    target_link_libraries(${name} INTERFACE weightsync_options ${ARG_DEPS})
  endif()
  add_library(weightsync::${name} ALIAS ${name})
endfunction()
