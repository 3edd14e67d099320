# Installs the public headers (the whole include/weightsync folder) and exports
# the targets for find_package(weightsync).
include(CMakePackageConfigHelpers)
install(DIRECTORY include/weightsync DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
set(_ws_targets weightsync weightsync_options weightsync_core weightsync_control
    weightsync_transport weightsync_engine weightsync_trainer)
if(TARGET weightsync_nccl_dep)
  list(APPEND _ws_targets weightsync_nccl_dep)
endif()
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
