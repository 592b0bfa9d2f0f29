# Compile flags shared by every Tessera target: warnings for host (C++) and device (CUDA) code (errors when
# TESSERA_WERROR is on), and -march=native when TESSERA_NATIVE is on.
function(tessera_set_warnings target)
  set(cxx_warnings -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wno-unknown-pragmas)
  set(cuda_host_warnings -Wall,-Wextra,-Wno-unknown-pragmas)
  if(TESSERA_WERROR)
    list(APPEND cxx_warnings -Werror)
    string(APPEND cuda_host_warnings ",-Werror")
  endif()
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:${cxx_warnings}>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=${cuda_host_warnings}>
    $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${TESSERA_WERROR}>>:-Werror=all-warnings>)
  if(TESSERA_NATIVE)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-march=native>
      $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-march=native>)
  endif()
endfunction()
