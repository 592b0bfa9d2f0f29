#!/bin/sh
# CUDA compiler launcher: ptxas-log.sh LOG_DIR nvcc ARGS...
# Runs the compilation, stores its ptxas report (stderr) next to the object's
# name in LOG_DIR for the cuda-build test, and passes on everything except the
# ptxas "info" lines so build logs stay readable.
log_dir=$1; shift
object=unknown
prev=
for arg in "$@"; do
  if [ "$prev" = "-o" ]; then object=$(basename "$arg"); fi
  prev=$arg
done
log="$log_dir/$object.log"
"$@" 2>"$log"
status=$?
grep -v -e '^ptxas info' -e '^    [0-9]* bytes stack frame' "$log" >&2
exit $status
