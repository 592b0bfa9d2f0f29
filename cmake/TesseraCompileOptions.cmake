# tessera_compile_options(target): the flags every Tessera target shares.
#   - warnings for host (C++) and device (CUDA) code, errors when TESSERA_WERROR is on;
#   - -fno-math-errno: math functions never set errno (nothing here reads it),
#     so sqrtf and friends inline and loops around them vectorise;
#   - the host processor: -march=native when TESSERA_NATIVE is on (AVX-512,
#     F16C, AMX on this machine: fastest here, but a binary may die with SIGILL
#     on a processor without the same extensions); otherwise the portable
#     baseline -march=${TESSERA_PORTABLE_ARCH} -mtune=generic, for builds that
#     travel (the GPU bundle, scripts/gpu-bundle.sh; the container images,
#     k8s/image). The default baseline, x86-64-v3 (AVX2, FMA, F16C, BMI1/2,
#     LZCNT, MOVBE: Intel Haswell (2013) and AMD Zen (2017) onwards), holds on
#     the x86-64 hosts that A100, H100 and H200 GPUs are sold in (Xeon Cascade
#     Lake and later, EPYC Rome and later); AVX-512 and AMX stay reachable
#     through oneDNN's and OpenBLAS's own run-time dispatch. An empty
#     TESSERA_PORTABLE_ARCH leaves the compiler's default (x86-64: SSE2 only).
function(tessera_compile_options target)
  set(cxx_flags -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wno-unknown-pragmas -fno-math-errno)
  set(cuda_host_flags -Wall,-Wextra,-Wno-unknown-pragmas,-fno-math-errno)
  if(TESSERA_WERROR)
    list(APPEND cxx_flags -Werror)
    string(APPEND cuda_host_flags ",-Werror")
  endif()
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:${cxx_flags}>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=${cuda_host_flags}>
    $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${TESSERA_WERROR}>>:-Werror=all-warnings>)
  if(TESSERA_NATIVE)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-march=native>
      $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-march=native>)
  elseif(NOT TESSERA_PORTABLE_ARCH STREQUAL "")
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-march=${TESSERA_PORTABLE_ARCH}>
      $<$<COMPILE_LANGUAGE:CXX>:-mtune=generic>
      $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-march=${TESSERA_PORTABLE_ARCH},-mtune=generic>)
  endif()
endfunction()
