# CUDA in the build (included by CMakeLists.txt after libtorch is found).
#
# Two modes, chosen at configure time:
#
# * CUDA build (SHOESTRING_WITH_CUDA): libtorch has CUDA (its CMake config
#   sets TORCH_CUDA_LIBRARIES, or c10_cuda / torch_cuda exist) and nvcc is
#   found. kernels/cuda/*.cu are compiled into shoestring_cuda_kernels and
#   linked into shoestring_core; host files named *_cuda.cpp (code that uses
#   c10/cuda headers, e.g. core/memory_ledger_cuda.cpp) join their folder's
#   library; SHOESTRING_WITH_CUDA=1 and SHOESTRING_WITH_CUDA_KERNELS=1 are
#   defined for every target; tests/cuda
#   builds the test_cuda suite (its tests skip when no GPU is present).
# * Compile-only check (libtorch without CUDA, nvcc and CUDA's headers
#   present, as on CI): the kernels are still compiled into
#   shoestring_cuda_kernels, which nothing links, and the OBJECT library
#   shoestring_cuda_compile_check compiles the *_cuda.cpp host files and
#   tests/cuda/*.cpp against libtorch's c10/cuda and ATen/cuda headers and
#   CUDA's headers, without linking, so a GPU build cannot rot unseen. Both
#   are part of the default build (scripts/build.sh, .ci/run). With
#   SHOESTRING_WERROR the C++ side builds with -Werror like the rest.
#
# Options: SHOESTRING_CUDA = AUTO (default) | ON (fail unless the CUDA build
# is possible) | OFF (no CUDA at all); CMAKE_CUDA_ARCHITECTURES (default 80 90,
# A100 and H100/H200); CUDACXX or CMAKE_CUDA_COMPILER to pick nvcc
# (/usr/local/cuda/bin/nvcc is tried when neither is set).
set(SHOESTRING_CUDA AUTO CACHE STRING "CUDA build: AUTO (when libtorch has CUDA), ON (required) or OFF")
set_property(CACHE SHOESTRING_CUDA PROPERTY STRINGS AUTO ON OFF)
# Kept for old build folders: OFF skips the kernels as SHOESTRING_CUDA=OFF does.
option(SHOESTRING_CUDA_KERNELS "Compile kernels/cuda when nvcc is found" ON)

set(SHOESTRING_WITH_CUDA OFF)
set(SHOESTRING_CUDA_CHECK OFF)
set(SHOESTRING_TORCH_HAS_CUDA OFF)
if(TORCH_CUDA_LIBRARIES OR TARGET torch_cuda OR TARGET c10_cuda)
  set(SHOESTRING_TORCH_HAS_CUDA ON)
endif()

if(NOT SHOESTRING_CUDA STREQUAL "OFF" AND SHOESTRING_CUDA_KERNELS)
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)  # A100 / H100-H200; override with -D
    endif()
    enable_language(CUDA)
    # CUDA::cudart and the toolkit's include folder (cuda_runtime.h, which
    # libtorch's c10/cuda headers include).
    find_package(CUDAToolkit REQUIRED)
    # nccl.h, for c10d's ProcessGroupNCCL (dist/nccl_collectives_cuda.cpp):
    # the toolkit's include folder, NCCL_INCLUDE_DIR, or the folder given as
    # SHOESTRING_NCCL_INCLUDE_DIR (gpu_check.sh passes pip's nvidia-nccl
    # one). Without it that file builds its fallback, which refuses several
    # processes on CUDA naming the missing header; the compile check also
    # defines USE_C10D_NCCL (the torch_cuda target does in a CUDA build) so
    # that the NCCL code itself is compiled.
    # pip's PyTorch: its nvidia-nccl package beside torch (Torch_DIR is
    # site-packages/torch/share/cmake/Torch), searched before the toolkit,
    # whose NCCL may be another version (make_nccl_collectives refuses a
    # mismatch at run time).
    set(nccl_hints "")
    if(Torch_DIR)
      get_filename_component(site_packages "${Torch_DIR}/../../../.." ABSOLUTE)
      list(APPEND nccl_hints "${site_packages}/nvidia/nccl/include")
    endif()
    find_path(SHOESTRING_NCCL_INCLUDE_DIR nccl.h HINTS ${nccl_hints} ENV NCCL_INCLUDE_DIR ${CUDAToolkit_INCLUDE_DIRS})
    if(SHOESTRING_NCCL_INCLUDE_DIR)
      set(nccl_defs SHOESTRING_HAVE_NCCL_H=1)
      if(NOT SHOESTRING_TORCH_HAS_CUDA)
        list(APPEND nccl_defs USE_C10D_NCCL)
      endif()
      set_source_files_properties(${CMAKE_SOURCE_DIR}/src/shoestring/dist/nccl_collectives_cuda.cpp PROPERTIES
        COMPILE_DEFINITIONS "${nccl_defs}" INCLUDE_DIRECTORIES "${SHOESTRING_NCCL_INCLUDE_DIR}"
        SKIP_PRECOMPILE_HEADERS ON)
      message(STATUS "shoestring: nccl.h in ${SHOESTRING_NCCL_INCLUDE_DIR}")
    else()
      message(STATUS "shoestring: nccl.h not found: several processes on CUDA will be refused "
                     "(set SHOESTRING_NCCL_INCLUDE_DIR)")
    endif()
    file(GLOB shoestring_cuda_srcs CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/kernels/cuda/*.cu)
    add_library(shoestring_cuda_kernels STATIC ${shoestring_cuda_srcs})
    target_include_directories(shoestring_cuda_kernels PUBLIC ${CMAKE_SOURCE_DIR} ${CMAKE_SOURCE_DIR}/src)
    target_link_libraries(shoestring_cuda_kernels PUBLIC CUDA::cudart)
    set_target_properties(shoestring_cuda_kernels PROPERTIES
      CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON POSITION_INDEPENDENT_CODE ON)
    if(SHOESTRING_TORCH_HAS_CUDA)
      set(SHOESTRING_WITH_CUDA ON)
      # SHOESTRING_WITH_CUDA_KERNELS: kernels/cuda is linked (always so in the CUDA build).
      target_compile_definitions(shoestring_flags INTERFACE SHOESTRING_WITH_CUDA=1 SHOESTRING_WITH_CUDA_KERNELS=1)
      message(STATUS "shoestring: CUDA build (${CMAKE_CUDA_COMPILER}, archs ${CMAKE_CUDA_ARCHITECTURES})")
    else()
      find_file(SHOESTRING_C10_CUDA_HEADER c10/cuda/CUDACachingAllocator.h PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
      if(SHOESTRING_C10_CUDA_HEADER)
        set(SHOESTRING_CUDA_CHECK ON)
        message(STATUS "shoestring: libtorch without CUDA; CUDA sources compile-checked only "
                       "(${CMAKE_CUDA_COMPILER}, archs ${CMAKE_CUDA_ARCHITECTURES})")
      else()
        message(STATUS "shoestring: libtorch without CUDA and without c10/cuda headers; only kernels/cuda is compiled")
      endif()
    endif()
  elseif(SHOESTRING_TORCH_HAS_CUDA)
    message(FATAL_ERROR "shoestring: libtorch has CUDA but nvcc was not found: set CUDACXX to nvcc's path, "
                        "or configure with -DSHOESTRING_CUDA=OFF")
  else()
    message(STATUS "shoestring: nvcc not found, CUDA kernels and their compile check skipped")
  endif()
endif()
if(SHOESTRING_CUDA STREQUAL "ON" AND NOT SHOESTRING_WITH_CUDA)
  message(FATAL_ERROR "shoestring: SHOESTRING_CUDA=ON but libtorch at ${Torch_DIR} has no CUDA "
                      "(TORCH_CUDA_LIBRARIES empty, no c10_cuda target) or nvcc is missing")
endif()

# shoestring_cuda_targets(): called after the modules are defined. The CUDA
# build gets test_cuda; the compile-only check gets
# shoestring_cuda_compile_check.
function(shoestring_cuda_targets)
  get_property(host_srcs GLOBAL PROPERTY SHOESTRING_CUDA_HOST_SOURCES)
  file(GLOB cuda_tests CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/tests/cuda/*.cpp)
  if(SHOESTRING_WITH_CUDA AND SHOESTRING_BUILD_TESTS AND cuda_tests)
    add_executable(test_cuda ${cuda_tests} ${CMAKE_SOURCE_DIR}/tests/test_main.cpp)
    target_link_libraries(test_cuda PRIVATE shoestring_train shoestring_optim shoestring_precision GTest::gtest
                                            GTest::gmock)
    target_compile_definitions(test_cuda PRIVATE SHOESTRING_TEST_DATA="${CMAKE_SOURCE_DIR}/tests/data"
                                                 SHOESTRING_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
    target_precompile_headers(test_cuda REUSE_FROM shoestring_pch)
    # The training test runs the real executable.
    add_dependencies(test_cuda shoestring)
    target_compile_definitions(test_cuda PRIVATE SHOESTRING_BINARY="$<TARGET_FILE:shoestring>")
    gtest_discover_tests(test_cuda DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 600)
  elseif(SHOESTRING_CUDA_CHECK)
    set(check_srcs ${host_srcs})
    if(SHOESTRING_BUILD_TESTS)
      list(APPEND check_srcs ${cuda_tests})
    endif()
    if(check_srcs)
      add_library(shoestring_cuda_compile_check OBJECT ${check_srcs})
      # Usage requirements only (an OBJECT library links nothing): our flags
      # and libtorch's headers, CUDA's headers, googletest's for the tests.
      target_link_libraries(shoestring_cuda_compile_check PRIVATE shoestring_flags CUDA::cudart)
      target_include_directories(shoestring_cuda_compile_check PRIVATE ${CMAKE_SOURCE_DIR})
      if(SHOESTRING_BUILD_TESTS)
        target_link_libraries(shoestring_cuda_compile_check PRIVATE GTest::gtest GTest::gmock)
      endif()
      target_compile_definitions(shoestring_cuda_compile_check PRIVATE SHOESTRING_WITH_CUDA=1
        SHOESTRING_TEST_DATA="${CMAKE_SOURCE_DIR}/tests/data" SHOESTRING_SOURCE_DIR="${CMAKE_SOURCE_DIR}"
        SHOESTRING_BINARY="shoestring")
      target_precompile_headers(shoestring_cuda_compile_check REUSE_FROM shoestring_pch)
      # A CPU-only libtorch package may ship c10/cuda's headers without the
      # one its CUDA build generates (c10/cuda/impl/cuda_cmake_macros.h, from
      # cuda_cmake_macros.h.in: C10_CUDA_BUILD_SHARED_LIBS for a shared
      # libc10_cuda, as every libtorch distribution has); supply it.
      find_file(SHOESTRING_C10_CUDA_MACROS c10/cuda/impl/cuda_cmake_macros.h PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
      if(NOT SHOESTRING_C10_CUDA_MACROS)
        set(compat ${CMAKE_BINARY_DIR}/cuda-compat-include)
        file(WRITE ${compat}/c10/cuda/impl/cuda_cmake_macros.h
             "// Written by cmake/cuda.cmake for the CUDA compile check (see there).\n"
             "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        target_include_directories(shoestring_cuda_compile_check SYSTEM PRIVATE ${compat})
      endif()
    endif()
  endif()
endfunction()
