# Runs one libFuzzer harness for a bounded time and fails on any finding: a
# crash, an uncaught exception, an AddressSanitizer or UBSan report (every
# UBSan check is fatal in this build), a leak, an input that runs longer
# than 30 s (a hang) or a process over 2 GiB (a runaway allocation). Run by
# CTest as `cmake -P` (tests/CMakeLists.txt):
#   -DFUZZER=build/fuzz/fuzz_dataset  the harness
#   -DSEEDS=tests/fuzz/corpus/...     the committed seed corpus (read only)
#   -DWORK_DIR=...                    the run's corpus (kept between runs, so
#                                     each run starts where the last stopped;
#                                     not for a canary), findings and log
#   -DSECONDS=20                      how long to fuzz
#   -DEXPECT=regex                    optional: the canary mode: the run must
#                                     end in a finding whose report matches
#   -DCANARY_KIND=asan|ubsan|leak     optional: TESSERA_FUZZ_CANARY_KIND
# Scratch files go to a directory of their own in /dev/shm when it exists
# (file system work is most of the harnesses' time), else in WORK_DIR.
get_filename_component(name "${FUZZER}" NAME)
file(MAKE_DIRECTORY "${WORK_DIR}")
file(LOCK "${WORK_DIR}/run.lock" GUARD PROCESS TIMEOUT 600)  # one run of a harness at a time
if(DEFINED EXPECT)
  file(REMOVE_RECURSE "${WORK_DIR}/corpus")  # the canary starts from the seeds alone, every time
endif()
file(MAKE_DIRECTORY "${WORK_DIR}/corpus")
file(GLOB old_findings "${WORK_DIR}/crash-*" "${WORK_DIR}/leak-*" "${WORK_DIR}/timeout-*" "${WORK_DIR}/oom-*")
if(old_findings)
  file(REMOVE ${old_findings})
endif()
string(RANDOM LENGTH 8 token)
if(IS_DIRECTORY /dev/shm)
  set(scratch "/dev/shm/tessera-${name}-${token}")
else()
  set(scratch "${WORK_DIR}/tmp-${token}")
endif()
file(MAKE_DIRECTORY "${scratch}")
set(ENV{TMPDIR} "${scratch}")
set(ENV{UBSAN_OPTIONS} "print_stacktrace=1:halt_on_error=1")
set(ENV{ASAN_OPTIONS} "detect_leaks=1:abort_on_error=0")
if(DEFINED CANARY_KIND)
  set(ENV{TESSERA_FUZZ_CANARY_KIND} "${CANARY_KIND}")
endif()

set(command "${FUZZER}" -max_total_time=${SECONDS} -rss_limit_mb=2048 -timeout=30 -print_final_stats=1
            "-artifact_prefix=${WORK_DIR}/" "${WORK_DIR}/corpus" "${SEEDS}")
math(EXPR deadline "${SECONDS} + 120")
execute_process(COMMAND ${command} RESULT_VARIABLE status OUTPUT_VARIABLE output ERROR_VARIABLE output
                TIMEOUT ${deadline})
file(REMOVE_RECURSE "${scratch}")
file(WRITE "${WORK_DIR}/fuzz.log" "${output}")
file(GLOB findings "${WORK_DIR}/crash-*" "${WORK_DIR}/leak-*" "${WORK_DIR}/timeout-*" "${WORK_DIR}/oom-*")

# The report: from the sanitizer's or libFuzzer's first error line to the end.
string(REGEX MATCH "(==[0-9]+==[ ]?ERROR|[^\n]*runtime error:|fuzz: |terminate called)[^\n]*\n.*" report "${output}")
if(NOT report)  # no report to cut out (e.g. the harness could not start): the output's last lines
  string(LENGTH "${output}" length)
  if(length GREATER 3000)
    math(EXPR start "${length} - 3000")
    string(SUBSTRING "${output}" ${start} -1 report)
  else()
    set(report "${output}")
  endif()
endif()
string(REGEX MATCH "stat::number_of_executed_units: *[0-9]+" runs "${output}")
string(REGEX MATCHALL "cov: [0-9]+ ft: [0-9]+ corp: [0-9]+" coverage "${output}")
if(coverage)
  list(GET coverage -1 coverage)
endif()

if(DEFINED EXPECT)
  if(status EQUAL 0 OR NOT report MATCHES "${EXPECT}")
    message(FATAL_ERROR "${name}: the deliberate bug (${CANARY_KIND}) was not reported within ${SECONDS} s "
                        "(exit ${status}; expected a report matching '${EXPECT}'); log: ${WORK_DIR}/fuzz.log\n${report}")
  endif()
  message("${name}: the deliberate ${CANARY_KIND} bug was found and reported as expected (${runs})")
  return()
endif()

if(NOT status EQUAL 0 OR findings)
  string(LENGTH "${report}" length)
  if(length GREATER 12000)
    string(SUBSTRING "${report}" 0 12000 report)
  endif()
  string(REPLACE ";" " " findings_text "${findings}")
  message(FATAL_ERROR "${name} found a bug (exit ${status}). Reproduce with\n"
                      "  ${FUZZER} ${findings_text}\n"
                      "full log: ${WORK_DIR}/fuzz.log\n\n${report}")
endif()
message("${name}: ${SECONDS} s, no finding (${runs}; ${coverage})")
