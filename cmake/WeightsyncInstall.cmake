# Installs the public headers (the whole include/weightsync folder) and exports
# the targets for find_package(weightsync).
include(CMakePackageConfigHelpers)
install(DIRECTORY include/weightsync DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
set(_ws_targets weightsync weightsync_options weightsync_core weightsync_layouts
    weightsync_control weightsync_transport weightsync_pipeline weightsync_engine
    weightsync_trainer)
install(TARGETS ${_ws_targets} EXPORT weightsyncTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(TARGET weightsync_cli)
  install(TARGETS weightsync_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(EXPORT weightsyncTargets NAMESPACE weightsync::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/weightsync)
configure_package_config_file(cmake/weightsyncConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/weightsyncConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/weightsync)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/weightsyncConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/weightsyncConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/weightsyncConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/weightsync)

# Data files the command finds beside itself (tools/weightsync/cli.h,
# find_data): the benches' peer baselines, the planner's recorded times
# (bench plan) and the model configs, under share/weightsync as they sit in
# the source tree.
set(_ws_data_scripts tools/bench/peer_baseline.py tools/bench/peer_ipc_baseline.py
                      tools/bench/peer_checkpoint_engine.py tools/bench/plan_reference.json)
set(_ws_bench_scripts tools/bench/python/bench.py tools/bench/python/bench_engine.py)
install(FILES ${_ws_data_scripts} DESTINATION ${CMAKE_INSTALL_DATADIR}/weightsync/tools/bench)
install(FILES ${_ws_bench_scripts} DESTINATION ${CMAKE_INSTALL_DATADIR}/weightsync/tools/bench/python)
install(DIRECTORY configs DESTINATION ${CMAKE_INSTALL_DATADIR}/weightsync)
# The Python package ships the command as weightsync/bin/weightsync (component
# "python", python/CMakeLists.txt): its data goes to weightsync/share/weightsync.
# Only in that component's own install (scikit-build-core asks for it), so a
# plain `cmake --install` does not put a package folder at the prefix.
if(WEIGHTSYNC_HAVE_PYTHON AND TARGET weightsync_cli)
  install(FILES ${_ws_data_scripts} DESTINATION weightsync/share/weightsync/tools/bench
          COMPONENT python EXCLUDE_FROM_ALL)
  install(FILES ${_ws_bench_scripts} DESTINATION weightsync/share/weightsync/tools/bench/python
          COMPONENT python EXCLUDE_FROM_ALL)
  install(DIRECTORY configs DESTINATION weightsync/share/weightsync
          COMPONENT python EXCLUDE_FROM_ALL)
endif()
