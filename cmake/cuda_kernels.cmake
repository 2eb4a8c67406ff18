# Builds libjax_flash_cuda.so: the CuTe DSL kernels, exported ahead of time to
# object files, plus their launchers and the CUDA FFI handlers. It holds no
# Python, so a single build serves every interpreter. No CUDA compiler runs:
# the DSL compiles the kernels itself (its own bundled toolchain) and the
# launchers and handlers are C++ for the host compiler, which only needs the
# CUDA runtime's headers and static library.
#
# Sets jf_cuda_summary (what the CUDA part of the build is) for the summary
# line of CMakeLists.txt.

string(TOUPPER "${JAX_FLASH_CUDA}" jf_cuda_mode)
if(jf_cuda_mode STREQUAL "OFF")
  set(jf_cuda_summary "no CUDA kernels (JAX_FLASH_CUDA=OFF)")
  return()
elseif(jf_cuda_mode STREQUAL "AUTO")
  # The CuTe DSL and the CUDA packages the build requires exist for Linux
  # x86-64 only (pyproject.toml); there AUTO means ON, so that a missing
  # piece fails the build instead of quietly dropping the GPU kernels.
  if(CMAKE_SYSTEM_NAME STREQUAL "Linux" AND CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64)$")
    set(jf_cuda_mode "ON")
  else()
    set(jf_cuda_summary "no CUDA kernels (they are built on Linux x86-64 only; this is \
${CMAKE_SYSTEM_NAME} ${CMAKE_SYSTEM_PROCESSOR})")
    return()
  endif()
elseif(NOT jf_cuda_mode STREQUAL "ON")
  message(FATAL_ERROR "jax_flash: JAX_FLASH_CUDA must be AUTO, ON or OFF, got '${JAX_FLASH_CUDA}'")
endif()

# ---- The CUDA runtime: headers and libcudart_static.a ------------------------
# PIP (default): from the build requirements nvidia-cuda-runtime, -crt and
# -cccl, so that no CUDA toolkit is needed and every build uses the same
# one; CMake's FindCUDAToolkit is not called, so a toolkit in /usr/local/cuda
# cannot slip in. SYSTEM: a CUDA toolkit found by FindCUDAToolkit
# (CUDAToolkit_ROOT, nvcc on PATH, /usr/local/cuda), for machines whose
# builds must use their own (scripts/gpu_check.sh AOT_DIR does).
set(JAX_FLASH_CUDA_TOOLKIT "PIP" CACHE STRING
    "Where the CUDA runtime headers and static library come from: PIP or SYSTEM")
set_property(CACHE JAX_FLASH_CUDA_TOOLKIT PROPERTY STRINGS PIP SYSTEM)
string(TOUPPER "${JAX_FLASH_CUDA_TOOLKIT}" jf_toolkit)
find_package(Threads REQUIRED)
if(jf_toolkit STREQUAL "PIP")
  execute_process(
    COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_SOURCE_DIR}/cmake/pip_cuda.py"
    OUTPUT_VARIABLE jf_pip_cuda ERROR_VARIABLE jf_pip_cuda_error
    RESULT_VARIABLE jf_pip_cuda_status ERROR_STRIP_TRAILING_WHITESPACE)
  if(NOT jf_pip_cuda_status EQUAL 0)
    message(FATAL_ERROR
      "jax_flash: ${jf_pip_cuda_error}. The CUDA kernels take the CUDA runtime's headers and "
      "static library from the build requirements nvidia-cuda-runtime, nvidia-cuda-crt and "
      "nvidia-cuda-cccl (pyproject.toml), which pip installs unless it runs with "
      "--no-build-isolation. Install them, or build against a CUDA toolkit with "
      "-Ccmake.define.JAX_FLASH_CUDA_TOOLKIT=SYSTEM, or without the GPU kernels with "
      "-Ccmake.define.JAX_FLASH_CUDA=OFF.")
  endif()
  list(POP_FRONT jf_pip_cuda jf_cuda_version jf_cudart_library)
  add_library(jf_cudart_static STATIC IMPORTED)
  # The system libraries libcudart_static.a needs, as FindCUDAToolkit lists them.
  set_target_properties(jf_cudart_static PROPERTIES
    IMPORTED_LOCATION "${jf_cudart_library}"
    INTERFACE_INCLUDE_DIRECTORIES "${jf_pip_cuda}"
    INTERFACE_LINK_LIBRARIES "Threads::Threads;${CMAKE_DL_LIBS};rt")
  get_filename_component(jf_cuda_where "${jf_cudart_library}/../.." ABSOLUTE)
  set(jf_cuda_where "pip (${jf_cuda_where})")
elseif(jf_toolkit STREQUAL "SYSTEM")
  find_package(CUDAToolkit REQUIRED)
  add_library(jf_cudart_static INTERFACE)
  target_link_libraries(jf_cudart_static INTERFACE CUDA::cudart_static)
  set(jf_cuda_version "${CUDAToolkit_VERSION}")
  set(jf_cuda_where "the CUDA toolkit (${CUDAToolkit_LIBRARY_DIR})")
else()
  message(FATAL_ERROR "jax_flash: JAX_FLASH_CUDA_TOOLKIT must be PIP or SYSTEM, got "
                      "'${JAX_FLASH_CUDA_TOOLKIT}'")
endif()

# ---- The kernels ------------------------------------------------------------
# Each kernel family (a folder of cuda_src with kernel.py, export.py and
# launch.cc) and the architectures it is exported for. The sm80 family also
# serves Hopper when the sm90 one declines a problem. Which GPUs may call
# them: jax_flash/_gpu_support.py.
set(JF_KERNEL_FAMILIES fwd_sm80 bwd_sm80 fwd_sm90 bwd_sm90 mla_sm90 CACHE STRING
    "Kernel families to build (folders of cuda_src)")
set(JF_FAMILY_ARCHS_fwd_sm90 sm_90a)
set(JF_FAMILY_ARCHS_fwd_sm80 sm_80 sm_90a)
set(JF_FAMILY_ARCHS_bwd_sm80 sm_80 sm_90a)
set(JF_FAMILY_ARCHS_bwd_sm90 sm_90a)
set(JF_FAMILY_ARCHS_mla_sm90 sm_90a)
# The MLA kernel traces the Hopper forward's online softmax.
set(JF_FAMILY_SOURCES_mla_sm90 ${CMAKE_CURRENT_SOURCE_DIR}/cuda_src/fwd_sm90/__init__.py
    ${CMAKE_CURRENT_SOURCE_DIR}/cuda_src/fwd_sm90/online_softmax.py)
# Each family and architecture is exported by this many processes, which
# the build tool runs in parallel: one process per family left one core
# compiling the Hopper forward alone for the last two of six minutes on two
# cores. A process costs under a second of its own.
set(JF_AOT_SHARDS 4 CACHE STRING "Processes that export each kernel family and architecture")

if(JAX_FLASH_AOT_DIR)
  set(jf_aot_dir "${JAX_FLASH_AOT_DIR}")
  set(jf_kernels_from "linked from the prebuilt ${jf_aot_dir}")
else()
  set(jf_aot_dir "${CMAKE_CURRENT_BINARY_DIR}/aot")
endif()

# The DSL's runtime (module loading for the exported kernels): static, from
# the DSL package, or from the prebuilt folder when that holds one.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import importlib.metadata as m, nvidia_cutlass_dsl, pathlib; print(m.version('nvidia-cutlass-dsl'), pathlib.Path(list(nvidia_cutlass_dsl.__path__)[0]) / 'cu13' / 'lib' / 'libcuda_dialect_runtime_static.a', sep=';', end='')"
  OUTPUT_VARIABLE jf_dsl RESULT_VARIABLE jf_dsl_status ERROR_QUIET)
if(jf_dsl_status EQUAL 0)
  list(GET jf_dsl 0 jf_dsl_version)
  list(GET jf_dsl 1 jf_dsl_runtime)
endif()
if(JAX_FLASH_AOT_DIR AND EXISTS "${jf_aot_dir}/libcuda_dialect_runtime_static.a")
  set(jf_dsl_runtime "${jf_aot_dir}/libcuda_dialect_runtime_static.a")
elseif(NOT jf_dsl_status EQUAL 0 OR NOT EXISTS "${jf_dsl_runtime}")
  message(FATAL_ERROR
    "jax_flash: the CUDA kernels need the build requirement nvidia-cutlass-dsl[cu13] (the CuTe "
    "DSL), which pip installs unless it runs with --no-build-isolation. Install it, or build "
    "without the GPU kernels with -Ccmake.define.JAX_FLASH_CUDA=OFF.")
endif()
if(NOT JAX_FLASH_AOT_DIR)
  set(jf_kernels_from "compiled by the CuTe DSL ${jf_dsl_version} in ${JF_AOT_SHARDS} processes each")
endif()

# The exports run as modules of the build-time package cuda_src, from the
# source folder; PYTHONSAFEPATH would keep that folder off sys.path.
set(jf_export ${CMAKE_COMMAND} -E env --unset=PYTHONSAFEPATH
    "${Python_EXECUTABLE}" -m cuda_src.export_kernels)
set(jf_export_sources ${CMAKE_CURRENT_SOURCE_DIR}/cuda_src/__init__.py
    ${CMAKE_CURRENT_SOURCE_DIR}/cuda_src/export_kernels.py
    ${CMAKE_CURRENT_SOURCE_DIR}/cuda_src/sass_checks.py)
set(jf_archives "")
set(jf_launchers "")
set(jf_include_dirs "")
set(jf_definitions "")
set(jf_built "")
foreach(family IN LISTS JF_KERNEL_FAMILIES)
  list(APPEND jf_launchers cuda_src/${family}/launch.cc)
  string(TOUPPER "${family}" family_upper)
  list(APPEND jf_definitions JF_HAVE_${family_upper}=1)
  string(REPLACE ";" " " family_archs "${JF_FAMILY_ARCHS_${family}}")
  list(APPEND jf_built "${family} (${family_archs})")
  foreach(arch IN LISTS JF_FAMILY_ARCHS_${family})
    list(APPEND jf_include_dirs "${jf_aot_dir}/${family}_${arch}")
    set(name ${family}_${arch})
    set(archive "${jf_aot_dir}/lib${name}.a")
    if(NOT JAX_FLASH_AOT_DIR)
      file(GLOB family_sources CONFIGURE_DEPENDS
           ${CMAKE_CURRENT_SOURCE_DIR}/cuda_src/${family}/*.py
           ${CMAKE_CURRENT_SOURCE_DIR}/cuda_src/common/*.py)
      list(APPEND family_sources ${JF_FAMILY_SOURCES_${family}})
      set(stamps "")
      foreach(shard RANGE 1 ${JF_AOT_SHARDS})
        set(stamp "${jf_aot_dir}/${name}.shards/${shard}.done")
        add_custom_command(
          OUTPUT "${stamp}"
          COMMAND ${jf_export} --family ${family} --arch ${arch}
                  --out "${jf_aot_dir}" --shard ${shard}/${JF_AOT_SHARDS}
          DEPENDS ${family_sources} ${jf_export_sources}
          WORKING_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}"
          COMMENT "jax_flash: compiling ${family} CuTe DSL kernels for ${arch} ahead of time (${shard}/${JF_AOT_SHARDS})"
          VERBATIM)
        list(APPEND stamps "${stamp}")
      endforeach()
      add_custom_command(
        OUTPUT "${archive}" "${jf_aot_dir}/${name}/${family}_variants_${arch}.h"
        COMMAND ${jf_export} --family ${family} --arch ${arch}
                --out "${jf_aot_dir}" --combine ${JF_AOT_SHARDS}
        DEPENDS ${stamps} ${jf_export_sources}
        WORKING_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}"
        COMMENT "jax_flash: packing the ${family} kernels for ${arch}"
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
target_link_libraries(jax_flash_cuda PRIVATE ${jf_archives} "${jf_dsl_runtime}" jf_cudart_static)
# Keep the static runtimes' symbols private so they never clash with the
# CUDA runtime that jaxlib or torch load into the same process.
target_link_options(jax_flash_cuda PRIVATE "LINKER:--exclude-libs,ALL" "LINKER:--no-undefined")
install(TARGETS jax_flash_cuda LIBRARY DESTINATION jax_flash)

list(JOIN jf_built ", " jf_built)
set(jf_cuda_summary "the CUDA kernels in libjax_flash_cuda.so: ${jf_built}, ${jf_kernels_from}; \
CUDA ${jf_cuda_version} runtime from ${jf_cuda_where}")
