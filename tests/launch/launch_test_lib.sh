# shellcheck shell=bash
# Helpers for the launch tests (sourced): failing with context, and waiting
# for Slurm jobs with a deadline. Every wait is bounded; a job still running
# at its deadline is cancelled and its log shown.

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# expect_grep PATTERN FILE WHAT: FILE has a line matching the extended regex.
expect_grep() {
  grep -Eq -- "$1" "$2" || {
    echo "---- $2 ----" >&2
    tail -n 60 "$2" >&2
    fail "$3: no line matching '$1' in $2"
  }
}

# job_field ID NAME: a field of `scontrol show job` (JobState, Restarts, ExitCode, ...).
job_field() {
  scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p"
}

# wait_for_job ID SECONDS LOG: poll squeue every 0.2 s (sbatch --wait polls every
# 2-10 s) until the job has left the queue; on the deadline cancel it and fail.
wait_for_job() {
  local id=$1 deadline=$((SECONDS + $2)) log=$3
  while [[ -n $(squeue -h -j "$id" 2>/dev/null) ]]; do
    if ((SECONDS >= deadline)); then
      scancel "$id" 2>/dev/null || true
      [[ -f $log ]] && tail -n 60 "$log" >&2
      fail "job $id still in the queue after $2 s (state $(job_field "$id" JobState)); cancelled"
    fi
    sleep 0.2
  done
}

# train_steps METRICS: the "step" of every "kind":"train" line, one per line.
train_steps() {
  sed -n 's/^{"kind":"train","step":\([0-9]*\),.*/\1/p' "$1"
}

# train_field METRICS STEP FIELD: a numeric field of that step's train line.
train_field() {
  sed -n "s/^{\"kind\":\"train\",\"step\":$2,.*\"$3\":\([-0-9.e+]*\).*/\1/p" "$1" | head -1
}

# expect_steps METRICS LAST: train lines for steps 1..LAST, each exactly once, in order.
expect_steps() {
  local expected actual
  expected=$(seq 1 "$2")
  actual=$(train_steps "$1")
  if [[ $actual != "$expected" ]]; then
    diff <(echo "$expected") <(echo "$actual") | head -20 >&2
    fail "$1: the train steps are not 1..$2 once each ($(wc -l <<<"$actual") lines; diff above)"
  fi
}
