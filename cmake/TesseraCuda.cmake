# Decides whether the CUDA backend is built (TESSERA_CUDA = AUTO | ON | OFF),
# enables the CUDA language, finds the toolkit's libraries, and provides
# tessera_log_ptxas(), which records the `ptxas -v` report of every kernel
# so the `cuda-build` test can check it for register spills.
include(CheckLanguage)

string(TOUPPER "${TESSERA_CUDA}" _tessera_cuda_mode)
if(NOT _tessera_cuda_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "TESSERA_CUDA must be AUTO, ON or OFF (got '${TESSERA_CUDA}')")
endif()

set(TESSERA_WITH_CUDA OFF)
set(TESSERA_NVCC_FOUND OFF)
check_language(CUDA)
if(CMAKE_CUDA_COMPILER)
  set(TESSERA_NVCC_FOUND ON)
endif()

if(_tessera_cuda_mode STREQUAL "ON" AND NOT TESSERA_NVCC_FOUND)
  message(FATAL_ERROR "TESSERA_CUDA=ON but no CUDA compiler was found. Install the CUDA toolkit, "
                      "put nvcc on PATH or pass -DCMAKE_CUDA_COMPILER=/path/to/nvcc, or use -DTESSERA_CUDA=OFF.")
endif()

if(TESSERA_NVCC_FOUND AND NOT _tessera_cuda_mode STREQUAL "OFF")
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "80;90")
  endif()
  enable_language(CUDA)
  # CMake 3.25 does not know nvcc's C++20 flag (3.26 does); teach it.
  if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
  find_package(CUDNN 9 REQUIRED MODULE)
  find_package(NCCL 2 REQUIRED MODULE)
  set(TESSERA_WITH_CUDA ON)
endif()
set(TESSERA_CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")

# Every CUDA compilation of `target` goes through a launcher that keeps the
# `-Xptxas -v` report (registers, stack, spills per kernel) in
# ${CMAKE_BINARY_DIR}/ptxas/<object>.log while still printing compiler errors.
function(tessera_log_ptxas target)
  set(log_dir "${CMAKE_BINARY_DIR}/ptxas")
  file(MAKE_DIRECTORY "${log_dir}")
  set_property(TARGET ${target} PROPERTY CUDA_COMPILER_LAUNCHER
    "${CMAKE_SOURCE_DIR}/cmake/ptxas-log.sh;${log_dir}")
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=-v>)
endfunction()
