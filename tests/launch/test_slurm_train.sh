#!/usr/bin/env bash
# slurm_train_cpu: slurm/train-cpu.sbatch submitted to the real single-host
# cluster for 2 nodes x 1 task trains the MLP on Fashion-MNIST (60 steps, two
# data-parallel ranks over srun --mpi=pmix, each through tessera-rank). Checks
# the job's state and exit code in slurmctld, the log (one rank on each node,
# the topology line tessera-rank printed for each, MPI's view of 2 nodes,
# checkpoints, the finish line), the metrics (steps 1..60 once each, the loss
# going down, held-out accuracy well above chance) and the checkpoint
# (`tessera checkpoint inspect`: step 60, dp=2, checksums).
#
# With MODE gpu-script (slurm_train_gpu_script) the GPU script,
# slurm/train.sbatch, runs the same job: its directives (--exclusive, 8 tasks
# and 8 GPUs per node, ...) as a real sbatch reads them, with the GPU count
# and tasks overridden on the command line for this GPU-less cluster and
# --device cpu, which keeps the script from adding --device cuda.
#   test_slurm_train.sh SOURCE_DIR CLUSTER_DIR DATA_DIR WORK_DIR TESSERA [cpu-script|gpu-script]
set -euo pipefail
source=$1 cluster=$2 data=$3 work=$4
export TESSERA=$5
script=$source/slurm/train-cpu.sbatch submit_options=() train_options=()
if [[ ${6:-cpu-script} == gpu-script ]]; then
  script=$source/slurm/train.sbatch submit_options=(--gpus-per-node=0) train_options=(--device cpu)
fi
source "$(dirname "$0")/launch_test_lib.sh"
source "$cluster/env"

rm -rf "$work" && mkdir -p "$work"
save=$work/ckpt metrics=$work/metrics.jsonl
id=$(sbatch --parsable "${submit_options[@]}" --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 --time=10 \
  --chdir="$work" --output="$work/job-%j.out" "$script" "${train_options[@]}" \
  --model mlp --hidden 64 --data "$data/fashion-mnist-train.h5" --eval-data "$data/fashion-mnist-test.h5" \
  --micro-batch-size 32 --train-steps 60 --eval-interval 30 --log-interval 10 \
  --save "$save" --save-interval 30 --metrics "$metrics")
log=$work/job-$id.out
echo "submitted job $id; log $log"
wait_for_job "$id" 150 "$log"

state=$(job_field "$id" JobState) exit_code=$(job_field "$id" ExitCode) restarts=$(job_field "$id" Restarts)
echo "job $id: JobState=$state ExitCode=$exit_code Restarts=$restarts NodeList=$(job_field "$id" NodeList)"
[[ $state == COMPLETED && $exit_code == 0:0 ]] || { cat "$log" >&2; fail "job $id ended $state with $exit_code"; }
[[ $restarts == 0 ]] || fail "job $id was restarted $restarts times; expected none"

expect_grep '^tessera-srun-train: job [0-9]+ run 1 .* on n\[1-2\]: 2 nodes, 2 tasks' "$log" "the job header"
expect_grep '^tessera-rank: n1: local rank 0 of 1: .*(TCP|RoCE|InfiniBand)' "$log" "topology line of node n1"
expect_grep '^tessera-rank: n2: local rank 0 of 1: ' "$log" "topology line of node n2"
expect_grep '^ranks: world 2 ranks on 2 nodes' "$log" "MPI's layout"
expect_grep "^no checkpoint in $save yet: starting from step 0" "$log" "a fresh start"
expect_grep "^checkpoint: $save/step_00000030 " "$log" "the periodic checkpoint"
expect_grep "^checkpoint: $save/step_00000060 " "$log" "the final checkpoint"
expect_grep '^tessera-srun-train: finished: step 60 of 60$' "$log" "the requeue decision"

expect_steps "$metrics" 60
first=$(train_field "$metrics" 1 loss) last=$(train_field "$metrics" 60 loss)
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.5) }' ||
  fail "the loss did not go down: step 1 $first, step 60 $last"
accuracy=$(sed -n 's/^{"kind":"eval","step":60,.*"eval_accuracy":\([0-9.]*\).*/\1/p' "$metrics")
[[ -n $accuracy ]] || fail "no evaluation at step 60 in $metrics"
awk -v a="$accuracy" 'BEGIN { exit !(a > 0.5) }' || fail "held-out accuracy $accuracy after 60 steps (chance is 0.1)"
echo "loss $first -> $last, held-out accuracy $accuracy"

[[ $(cat "$save/latest") == step_00000060 ]] || fail "$save/latest names '$(cat "$save/latest")', not step_00000060"
[[ -f $save/step_00000030/checkpoint.h5 ]] || fail "the step-30 checkpoint is missing"
inspect=$("$TESSERA" checkpoint inspect "$save") || fail "checkpoint inspect failed: $inspect"
grep -q '^step: 60$' <<<"$inspect" || fail "checkpoint inspect does not say step 60"
grep -q '^layout: dp=2 ' <<<"$inspect" || fail "the checkpoint was not written by dp=2: $(grep '^layout' <<<"$inspect")"
echo "PASS: job $id ($(basename "$script")) trained 60 steps on 2 Slurm nodes and checkpointed"
