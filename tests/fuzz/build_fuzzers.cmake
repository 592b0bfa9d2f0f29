# Configures and builds the fuzz project (tests/fuzz/CMakeLists.txt) with
# clang into BUILD_DIR. Run by CTest as `cmake -P` (the `fuzz_build` test,
# which the fuzz_* tests require); a configured BUILD_DIR is rebuilt
# incrementally.
#   -DSOURCE_DIR=tests/fuzz -DBUILD_DIR=build/fuzz -DGENERATOR=Ninja
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "command failed (${status}): ${ARGV}\n${out}\n${err}")
  endif()
endfunction()

find_program(clangxx NAMES clang++)
find_program(clang NAMES clang)
if(NOT clangxx OR NOT clang)
  message(FATAL_ERROR "clang is not installed: the fuzz harnesses need clang and libFuzzer "
                      "(scripts/install-deps.sh installs clang, libclang-rt-dev and libomp-dev)")
endif()
# Two test runs at once (ctest -L fault beside ctest -L fuzz) build one after the other.
file(LOCK "${BUILD_DIR}.lock" GUARD PROCESS TIMEOUT 900)
run(${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${BUILD_DIR}" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${clangxx}" "-DCMAKE_C_COMPILER=${clang}")
run(${CMAKE_COMMAND} --build "${BUILD_DIR}")
message("fuzz harnesses built in ${BUILD_DIR}")
