#!/usr/bin/env bash
# slurm_preempt_requeue: a job of slurm/train-cpu.sbatch (2 nodes x 1 task,
# 1000 steps) gets its preemption warning, `scancel --signal=USR1` (what
# `#SBATCH --signal=USR1@120` sends before the time limit), once training is
# under way. The ranks write a checkpoint and exit 0, the batch script sees
# the run unfinished and requeues the job, and the second run resumes from
# that checkpoint to the end. Checks: one restart, COMPLETED with 0:0, the
# stop and resume lines naming the same step, the metrics holding steps
# 1..1000 exactly once (a restart from scratch would repeat steps), and the
# final checkpoint.
#
# With LAUNCHER mpirun (slurm_mpirun_preempt_requeue) the documented fallback
# runs instead: TESSERA_LAUNCHER=mpirun, the warning sent to the batch shell
# (`--signal=B:USR1@...`, here `scancel --batch --signal=USR1`), which passes
# it to mpirun, which passes it to every rank.
#   test_slurm_preempt.sh SOURCE_DIR CLUSTER_DIR DATA_DIR WORK_DIR TESSERA [srun|mpirun]
set -euo pipefail
source=$1 cluster=$2 data=$3 work=$4
export TESSERA=$5
launcher=${6:-srun}
submit_options=() signal_options=()
if [[ $launcher == mpirun ]]; then
  export TESSERA_LAUNCHER=mpirun
  submit_options=(--signal=B:USR1@120)
  signal_options=(--batch)
fi
source "$(dirname "$0")/launch_test_lib.sh"
source "$cluster/env"

rm -rf "$work" && mkdir -p "$work"
save=$work/ckpt metrics=$work/metrics.jsonl steps=1000
id=$(sbatch --parsable "${submit_options[@]}" --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 --time=10 --chdir="$work" \
  --output="$work/job-%j.out" "$source/slurm/train-cpu.sbatch" \
  --model mlp --hidden 256,256 --data "$data/fashion-mnist-train.h5" --eval-data "$data/fashion-mnist-test.h5" \
  --micro-batch-size 64 --train-steps $steps --eval-interval 500 --log-interval 100 \
  --save "$save" --save-interval 500 --metrics "$metrics")
log=$work/job-$id.out
echo "submitted job $id; log $log"

# Signal once step 50 is in the metrics (the trainer's handlers are in place).
deadline=$((SECONDS + 120))
until grep -q '^{"kind":"train","step":50,' "$metrics" 2>/dev/null; do
  [[ -n $(squeue -h -j "$id" 2>/dev/null) ]] || { cat "$log" >&2; fail "job $id ended before step 50"; }
  ((SECONDS < deadline)) || { scancel "$id"; fail "job $id did not reach step 50 within 120 s"; }
  sleep 0.1
done
scancel "${signal_options[@]}" --signal=USR1 "$id"
echo "sent SIGUSR1 to job $id ($launcher) at step $(train_steps "$metrics" | tail -1)"

wait_for_job "$id" 240 "$log"
state=$(job_field "$id" JobState) exit_code=$(job_field "$id" ExitCode) restarts=$(job_field "$id" Restarts)
echo "job $id: JobState=$state ExitCode=$exit_code Restarts=$restarts"
[[ $state == COMPLETED && $exit_code == 0:0 ]] || { cat "$log" >&2; fail "job $id ended $state with $exit_code"; }
[[ $restarts == 1 ]] || { cat "$log" >&2; fail "job $id was restarted $restarts times; expected once"; }

expect_grep '^stopping: SIGUSR1 received by rank [01]; stopped after step [0-9]+; checkpoint' "$log" "the stop"
stopped=$(sed -n 's/^stopping: .*stopped after step \([0-9]*\);.*/\1/p' "$log" | head -1)
((stopped >= 50 && stopped < steps)) || fail "stopped after step $stopped; expected between 50 and $steps"
step_dir=$(printf 'step_%08d' "$stopped")
expect_grep "^tessera-srun-train: stopped at step $stopped of $steps; requeueing job $id" "$log" "the requeue"
expect_grep "^tessera-srun-train: job $id run 2 \\(restarts: 1\\)" "$log" "the second run"
expect_grep "^resumed from $save/$step_dir: step $stopped of $steps" "$log" "the resume from the signal's checkpoint"
expect_grep "^tessera-srun-train: finished: step $steps of $steps\$" "$log" "the end"
[[ $(grep -c '^tessera-rank: n[12]: ' "$log") == 4 ]] || fail "expected 4 tessera-rank lines (2 nodes x 2 runs)"

[[ $launcher != mpirun ]] || expect_grep '^mpirun: Forwarding signal 10 to job' "$log" "mpirun passing SIGUSR1 on"
expect_steps "$metrics" $steps
[[ $(cat "$save/latest") == "$(printf 'step_%08d' $steps)" ]] || fail "$save/latest is '$(cat "$save/latest")'"
"$TESSERA" checkpoint inspect "$save" >/dev/null || fail "the final checkpoint does not verify"
echo "PASS ($launcher): job $id stopped at step $stopped on SIGUSR1, was requeued, resumed from $step_dir and finished $steps steps"
