# Builds libjax_flash_cuda.so: the CuTe DSL kernels, exported ahead of time to
# object files, plus their launchers and the CUDA FFI handlers. It holds no
# Python, so a single build serves every interpreter.

string(TOUPPER "${JAX_FLASH_CUDA}" jf_cuda_mode)
if(jf_cuda_mode STREQUAL "OFF")
  message(STATUS "jax_flash: CUDA kernels disabled (JAX_FLASH_CUDA=OFF); building the CPU kernels only")
  return()
endif()

find_package(CUDAToolkit QUIET)
if(NOT CUDAToolkit_FOUND)
  if(jf_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "jax_flash: JAX_FLASH_CUDA=ON but no CUDA toolkit (nvcc) was found")
  endif()
  message(WARNING "jax_flash: no CUDA toolkit (nvcc) found; building the CPU kernels only")
  return()
endif()

# Each kernel family (a folder of cuda_src with kernel.py, export.py and
# launch.cc) and the architectures it is exported for. The sm80 family also
# serves Hopper when the sm90 one declines a problem.
set(JF_KERNEL_FAMILIES fwd_sm80 bwd_sm80 fwd_sm90 bwd_sm90 CACHE STRING
    "Kernel families to build (folders of cuda_src)")
set(JF_FAMILY_ARCHS_fwd_sm90 sm_90a)
set(JF_FAMILY_ARCHS_fwd_sm80 sm_80 sm_90a)
set(JF_FAMILY_ARCHS_bwd_sm80 sm_80 sm_90a)
set(JF_FAMILY_ARCHS_bwd_sm90 sm_90a)

if(JAX_FLASH_AOT_DIR)
  set(jf_aot_dir "${JAX_FLASH_AOT_DIR}")
  message(STATUS "jax_flash: linking prebuilt kernels from ${jf_aot_dir}")
else()
  set(jf_aot_dir "${CMAKE_CURRENT_BINARY_DIR}/aot")
endif()

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import nvidia_cutlass_dsl, pathlib; print(pathlib.Path(list(nvidia_cutlass_dsl.__path__)[0]) / 'cu13' / 'lib' / 'libcuda_dialect_runtime_static.a')"
  OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE jf_dsl_runtime
  RESULT_VARIABLE jf_dsl_status ERROR_QUIET)
if(JAX_FLASH_AOT_DIR AND EXISTS "${jf_aot_dir}/libcuda_dialect_runtime_static.a")
  set(jf_dsl_runtime "${jf_aot_dir}/libcuda_dialect_runtime_static.a")
elseif(NOT jf_dsl_status EQUAL 0 OR NOT EXISTS "${jf_dsl_runtime}")
  if(jf_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "jax_flash: nvidia-cutlass-dsl (cu13) is needed to build the CUDA kernels")
  endif()
  message(WARNING "jax_flash: nvidia-cutlass-dsl (cu13) not found; building the CPU kernels only")
  return()
endif()

set(jf_archives "")
set(jf_launchers "")
set(jf_include_dirs "")
set(jf_definitions "")
foreach(family IN LISTS JF_KERNEL_FAMILIES)
  list(APPEND jf_launchers cuda_src/${family}/launch.cc)
  string(TOUPPER "${family}" family_upper)
  list(APPEND jf_definitions JF_HAVE_${family_upper}=1)
  foreach(arch IN LISTS JF_FAMILY_ARCHS_${family})
    list(APPEND jf_include_dirs "${jf_aot_dir}/${family}_${arch}")
    set(name ${family}_${arch})
    set(archive "${jf_aot_dir}/lib${name}.a")
    if(NOT JAX_FLASH_AOT_DIR)
      file(GLOB family_sources CONFIGURE_DEPENDS
           ${CMAKE_CURRENT_SOURCE_DIR}/cuda_src/${family}/*.py
           ${CMAKE_CURRENT_SOURCE_DIR}/cuda_src/common/*.py)
      add_custom_command(
        OUTPUT "${archive}" "${jf_aot_dir}/${name}/${family}_variants_${arch}.h"
        COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_SOURCE_DIR}/cuda_src/export_kernels.py"
                --family ${family} --arch ${arch} --out "${jf_aot_dir}"
        DEPENDS ${family_sources} ${CMAKE_CURRENT_SOURCE_DIR}/cuda_src/export_kernels.py
                ${CMAKE_CURRENT_SOURCE_DIR}/cuda_src/sass_checks.py
        COMMENT "jax_flash: compiling ${family} CuTe DSL kernels for ${arch} ahead of time"
        VERBATIM)
    endif()
    list(APPEND jf_archives "${archive}")
  endforeach()
endforeach()
add_custom_target(jax_flash_aot_kernels DEPENDS ${jf_archives})

add_library(jax_flash_cuda SHARED cuda_src/ffi/cuda_handlers.cc ${jf_launchers})
add_dependencies(jax_flash_cuda jax_flash_aot_kernels)
target_include_directories(jax_flash_cuda PRIVATE ${JF_INCLUDE_DIRS} ${CMAKE_CURRENT_SOURCE_DIR}/cuda_src/common ${jf_include_dirs})
target_compile_definitions(jax_flash_cuda PRIVATE ${jf_definitions})
target_compile_options(jax_flash_cuda PRIVATE -O2)
target_link_libraries(jax_flash_cuda PRIVATE
  ${jf_archives} "${jf_dsl_runtime}" CUDA::cudart_static)
# Keep the static runtimes' symbols private so they never clash with the
# CUDA runtime that jaxlib or torch load into the same process.
target_link_options(jax_flash_cuda PRIVATE "LINKER:--exclude-libs,ALL" "LINKER:--no-undefined")
install(TARGETS jax_flash_cuda LIBRARY DESTINATION jax_flash)
message(STATUS "jax_flash: building CUDA kernel families ${JF_KERNEL_FAMILIES}")
