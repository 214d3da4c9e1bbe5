# The dependencies from SHOESTRING_DEPS_DIR instead of system packages
# (included by CMakeLists.txt; the folder is written by
# `scripts/gpu_check.sh --pack`). Layout:
#   include/  toml++/ CLI/ nlohmann/ fmt/ spdlog/ and stb's headers
#   stb_impl.c  the one translation unit that compiles stb's implementations
#   googletest/  googletest's source tree (googletest/ and googlemock/)
# Defines the same target names the system packages give, so the rest of the
# build does not know the difference. fmt and spdlog are used header-only.
set(deps "${SHOESTRING_DEPS_DIR}")
foreach(f include/toml++/toml.h include/CLI/CLI.hpp include/nlohmann/json.hpp include/fmt/format.h
          include/spdlog/spdlog.h include/stb_image.h stb_impl.c)
  if(NOT EXISTS "${deps}/${f}")
    message(FATAL_ERROR "SHOESTRING_DEPS_DIR=${deps}: ${f} is missing (write the folder with scripts/gpu_check.sh --pack)")
  endif()
endforeach()

foreach(t tomlplusplus::tomlplusplus CLI11::CLI11 nlohmann_json::nlohmann_json fmt::fmt spdlog::spdlog)
  add_library(${t} INTERFACE IMPORTED)
  set_target_properties(${t} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${deps}/include")
endforeach()
set_property(TARGET fmt::fmt PROPERTY INTERFACE_COMPILE_DEFINITIONS FMT_HEADER_ONLY=1)
set_property(TARGET spdlog::spdlog PROPERTY INTERFACE_COMPILE_DEFINITIONS SPDLOG_HEADER_ONLY SPDLOG_FMT_EXTERNAL)
set_property(TARGET spdlog::spdlog PROPERTY INTERFACE_LINK_LIBRARIES fmt::fmt)

enable_language(C)
add_library(shoestring_vendored_stb STATIC "${deps}/stb_impl.c")
target_include_directories(shoestring_vendored_stb PUBLIC "${deps}/include")
set_target_properties(shoestring_vendored_stb PROPERTIES POSITION_INDEPENDENT_CODE ON)
add_library(PkgConfig::STB ALIAS shoestring_vendored_stb)

if(SHOESTRING_BUILD_TESTS)
  if(NOT EXISTS "${deps}/googletest/CMakeLists.txt")
    message(FATAL_ERROR "SHOESTRING_DEPS_DIR=${deps}: googletest/ is missing (scripts/gpu_check.sh --pack)")
  endif()
  set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
  set(BUILD_GMOCK ON CACHE BOOL "" FORCE)
  add_subdirectory("${deps}/googletest" "${CMAKE_BINARY_DIR}/vendored-googletest" EXCLUDE_FROM_ALL)
  foreach(t gtest gtest_main gmock gmock_main)
    # libtorch's C++ ABI flag (a PyTorch wheel may use the old ABI): googletest
    # passes std::string across its API, so it must match.
    if(TORCH_CXX_FLAGS)
      target_compile_options(${t} PRIVATE ${TORCH_CXX_FLAGS})
    endif()
    if(NOT TARGET GTest::${t})
      add_library(GTest::${t} ALIAS ${t})
    endif()
  endforeach()
endif()
