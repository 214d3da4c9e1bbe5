# ctest time bounds for single test_io tests, tighter than the suite-wide 600 s
# (CMakeLists.txt adds this file to the tests' include files, after the
# discovered tests). A bound here replaces a wall-clock assert in the test.
# ctest ignores a name it does not know (test_io not built yet).
set_tests_properties("SafetensorsScale" PROPERTIES TIMEOUT 60)  # Opens100000TensorHeader: linear-time header parse
