# baro_jax GPU libraries (owned by csrc/gpu). Included by CMakeLists.txt.
#
# Inputs (set by CMakeLists.txt / pyproject.toml):
#   BARO_GPU              auto | cuda | hip | none
#   BARO_CUDA_ARCHS       CMake CUDA architectures, e.g. "90" or "80;90" (default 90)
#   BARO_HIP_ARCHS        offload archs for hipcc, e.g. "gfx90a" or "gfx90a;gfx942"
#   BARO_FFI_INCLUDE_DIR  XLA FFI headers (jax.ffi.include_dir())
#   BARO_COMMON_INCLUDE_DIR  csrc/common (ffi_util.h)
#   BARO_INSTALL_DIR      where the libraries are installed (custom_calls)
#
# auto: builds libbaro_cuda.so when a CUDA compiler is found, else nothing.
# cuda: builds libbaro_cuda.so, fails when there is no CUDA compiler.
# hip:  builds libbaro_hip.so with hipcc (called directly; Debian's ROCm
#       packaging does not work with CMake's HIP language).
# none: builds no GPU library.
#
# Numerics flags: nvcc --fmad=false, hipcc -ffp-contract=off: the compiler may
# not fuse a*b+c; every fma in csrc/gpu is an explicit fmaf. No fast-math.

set(_baro_gpu_dir "${CMAKE_CURRENT_LIST_DIR}")
file(GLOB _baro_gpu_sources CONFIGURE_DEPENDS "${_baro_gpu_dir}/*.cu")
file(GLOB _baro_gpu_headers CONFIGURE_DEPENDS "${_baro_gpu_dir}/*.h" "${_baro_gpu_dir}/*.cuh"
     "${BARO_COMMON_INCLUDE_DIR}/*.h")
string(TOLOWER "${BARO_GPU}" _baro_gpu_mode)

if(_baro_gpu_mode STREQUAL "none")
  message(STATUS "baro_jax: BARO_GPU=none: no GPU library")

elseif(_baro_gpu_mode STREQUAL "auto" OR _baro_gpu_mode STREQUAL "cuda")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # Must be set before enable_language, or CMake picks its own default arch.
    if(NOT CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES "${BARO_CUDA_ARCHS}")
    endif()
    enable_language(CUDA)
    message(STATUS "baro_jax: building libbaro_cuda.so with ${CMAKE_CUDA_COMPILER} "
                   "(${CMAKE_CUDA_COMPILER_VERSION}) for CUDA architectures ${BARO_CUDA_ARCHS}")
    # The CUDA compile is most of the build (minutes on a small machine), and pip shows nothing
    # of it unless run with -v; this says what the wait is for, and how to skip it where no GPU
    # driver could run the library anyway (nvidia-smi is the driver's own tool).
    find_program(_baro_nvidia_smi nvidia-smi)
    if(_baro_nvidia_smi)
      set(_baro_driver_note "")
    else()
      string(CONCAT _baro_driver_note " No GPU driver found here (no nvidia-smi): the library is built but "
                    "cannot run on this machine; BARO_GPU=none skips it.")
    endif()
    message(NOTICE "baro_jax: compiling the CUDA kernels (libbaro_cuda.so for CUDA architectures "
                   "${BARO_CUDA_ARCHS}, BARO_GPU=${BARO_GPU}): the longest step of the build, a minute or more on "
                   "a few cores.${_baro_driver_note}")
    # attention_wgmma.cu and gemm_wgmma.cu use wgmma, which only the arch-specific sm_90a target
    # has: with 90 among the architectures they are built alone for sm_90a (their own object
    # library, the same numerics flags) and linked in; otherwise they compile with the others as
    # their stub launchers.
    set(_baro_wgmma_srcs "${_baro_gpu_dir}/attention_wgmma.cu" "${_baro_gpu_dir}/gemm_wgmma.cu")
    set(_baro_wgmma_present "")
    foreach(_src IN LISTS _baro_wgmma_srcs)
      if(EXISTS "${_src}")
        list(APPEND _baro_wgmma_present "${_src}")
      endif()
    endforeach()
    set(_baro_wgmma_objects "")
    set(_baro_archs_90 ${BARO_CUDA_ARCHS})
    list(FILTER _baro_archs_90 INCLUDE REGEX "^90")
    if(_baro_archs_90 AND _baro_wgmma_present)
      list(REMOVE_ITEM _baro_gpu_sources ${_baro_wgmma_present})
      add_library(baro_cuda_wgmma OBJECT ${_baro_wgmma_present})
      set_target_properties(baro_cuda_wgmma PROPERTIES
        CUDA_ARCHITECTURES OFF
        CUDA_STANDARD 17
        CUDA_STANDARD_REQUIRED ON
        POSITION_INDEPENDENT_CODE ON)
      target_include_directories(baro_cuda_wgmma SYSTEM PRIVATE "${BARO_FFI_INCLUDE_DIR}")
      target_include_directories(baro_cuda_wgmma PRIVATE "${_baro_gpu_dir}" "${BARO_COMMON_INCLUDE_DIR}")
      target_compile_definitions(baro_cuda_wgmma PRIVATE BARO_WGMMA=1)
      target_compile_options(baro_cuda_wgmma PRIVATE
        $<$<COMPILE_LANGUAGE:CUDA>:--fmad=false -Xcompiler=-fno-fast-math
        --generate-code=arch=compute_90a,code=sm_90a>)
      set(_baro_wgmma_objects $<TARGET_OBJECTS:baro_cuda_wgmma>)
    endif()
    add_library(baro_cuda SHARED ${_baro_gpu_sources} ${_baro_wgmma_objects})
    set_target_properties(baro_cuda PROPERTIES
      PREFIX "lib"
      OUTPUT_NAME "baro_cuda"
      CUDA_ARCHITECTURES "${BARO_CUDA_ARCHS}"
      CUDA_STANDARD 17
      CUDA_STANDARD_REQUIRED ON
      CUDA_RUNTIME_LIBRARY Static
      POSITION_INDEPENDENT_CODE ON)
    target_include_directories(baro_cuda SYSTEM PRIVATE "${BARO_FFI_INCLUDE_DIR}")
    target_include_directories(baro_cuda PRIVATE "${_baro_gpu_dir}" "${BARO_COMMON_INCLUDE_DIR}")
    target_compile_options(baro_cuda PRIVATE
      $<$<COMPILE_LANGUAGE:CUDA>:--fmad=false -Xcompiler=-fno-fast-math>)
    install(TARGETS baro_cuda
            LIBRARY DESTINATION "${BARO_INSTALL_DIR}"
            RUNTIME DESTINATION "${BARO_INSTALL_DIR}")
  elseif(_baro_gpu_mode STREQUAL "cuda")
    message(FATAL_ERROR
      "baro_jax: BARO_GPU=cuda but no CUDA compiler was found. Put nvcc on PATH "
      "(or set CUDACXX), or build with BARO_GPU=auto / none.")
  else()
    message(STATUS "baro_jax: no CUDA compiler found (BARO_GPU=auto): CPU library only")
  endif()

elseif(_baro_gpu_mode STREQUAL "hip")
  find_program(BARO_HIPCC NAMES hipcc HINTS "$ENV{ROCM_PATH}/bin" /opt/rocm/bin)
  if(NOT BARO_HIPCC)
    message(FATAL_ERROR
      "baro_jax: BARO_GPU=hip but hipcc was not found (Debian/Ubuntu: apt-get install hipcc "
      "libamdhip64-dev; or put ROCm's bin on PATH / set ROCM_PATH).")
  endif()
  set(_baro_hip_arch_flags "")
  foreach(_arch IN LISTS BARO_HIP_ARCHS)
    list(APPEND _baro_hip_arch_flags "--offload-arch=${_arch}")
  endforeach()
  set(_baro_hip_flags -std=c++17 -O3 -fPIC -ffp-contract=off -fno-fast-math
      ${_baro_hip_arch_flags}
      -I${_baro_gpu_dir} -I${BARO_COMMON_INCLUDE_DIR} -isystem ${BARO_FFI_INCLUDE_DIR})
  set(_baro_hip_objects "")
  foreach(_src IN LISTS _baro_gpu_sources)
    get_filename_component(_name "${_src}" NAME_WE)
    set(_obj "${CMAKE_CURRENT_BINARY_DIR}/baro_hip/${_name}.o")
    add_custom_command(
      OUTPUT "${_obj}"
      COMMAND ${CMAKE_COMMAND} -E make_directory "${CMAKE_CURRENT_BINARY_DIR}/baro_hip"
      COMMAND ${CMAKE_COMMAND} -E env HIP_PLATFORM=amd
              "${BARO_HIPCC}" ${_baro_hip_flags} -x hip -c "${_src}" -o "${_obj}"
      DEPENDS "${_src}" ${_baro_gpu_headers}
      COMMENT "hipcc ${_name}.cu"
      VERBATIM)
    list(APPEND _baro_hip_objects "${_obj}")
  endforeach()
  set(_baro_hip_lib "${CMAKE_CURRENT_BINARY_DIR}/libbaro_hip.so")
  add_custom_command(
    OUTPUT "${_baro_hip_lib}"
    COMMAND ${CMAKE_COMMAND} -E env HIP_PLATFORM=amd
            "${BARO_HIPCC}" -shared -fPIC ${_baro_hip_arch_flags} ${_baro_hip_objects}
            -o "${_baro_hip_lib}"
    DEPENDS ${_baro_hip_objects}
    COMMENT "hipcc: linking libbaro_hip.so for ${BARO_HIP_ARCHS}"
    VERBATIM)
  add_custom_target(baro_hip ALL DEPENDS "${_baro_hip_lib}")
  message(STATUS "baro_jax: building libbaro_hip.so with ${BARO_HIPCC} for ${BARO_HIP_ARCHS}")
  install(FILES "${_baro_hip_lib}" DESTINATION "${BARO_INSTALL_DIR}")

else()
  message(FATAL_ERROR "baro_jax: unknown BARO_GPU='${BARO_GPU}' (expected auto, cuda, hip or none)")
endif()
