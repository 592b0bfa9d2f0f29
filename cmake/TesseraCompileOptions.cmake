# tessera_compile_options(target): the flags every Tessera target shares.
#   - warnings for host (C++) and device (CUDA) code, errors when TESSERA_WERROR is on;
#   - -fno-math-errno: math functions never set errno (nothing here reads it),
#     so sqrtf and friends inline and loops around them vectorise;
#   - -march=native when TESSERA_NATIVE is on (AVX-512, F16C, AMX on this machine).
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
  endif()
endfunction()
