# The dependency rules of docs/architecture.md (tools/check_architecture.py):
# the tree as it is passes, with the libraries' symbols checked too; and the
# check fails on a forbidden include, a forbidden CMake dependency, a
# forbidden link and a stale entry of its list (check_rules_test.py).
find_program(_ws_arch_python3 NAMES python3)
if(_ws_arch_python3)
  add_test(NAME architecture.rules
           COMMAND ${_ws_arch_python3} ${PROJECT_SOURCE_DIR}/tools/check_architecture.py
                   --root ${PROJECT_SOURCE_DIR} --build ${PROJECT_BINARY_DIR})
  add_test(NAME architecture.check_fails_on_forbidden_arrows
           COMMAND ${_ws_arch_python3} ${CMAKE_CURRENT_LIST_DIR}/check_rules_test.py
                   ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
  set_tests_properties(architecture.rules architecture.check_fails_on_forbidden_arrows
                       PROPERTIES TIMEOUT 300 LABELS architecture)
endif()
