#!/usr/bin/env bash
# The GPU suite: everything of Tessera that needs a GPU, in one command, on a
# machine with one GPU (scripts/gpu-bundle.sh copies this file into the
# bundle as run-gpu-suite.sh; it runs from there, next to the bundle's bin/,
# lib/ and env.sh). Parts, each under a deadline, each run even when one
# before it failed:
#   environment   env.sh: glibc, processor extensions, the CUDA libraries and driver found here
#   version       tessera --version: the device, cuBLAS, cuDNN, NCCL
#   gpu tests     every *.Gpu* test of the packed test binaries (kernels; allocator, RNG,
#                 tensors; checkpoint, loader), GoogleTest
#   nccl 1 rank   the NCCL communicator tests under the bundle's mpirun -np 1
#   selfcheck     tessera selfcheck: every operator's backward, and cuda:0 against the CPU
#   prepare       Fashion-MNIST t10k and the fortunes text into HDF5 (tessera prepare)
#   train         MLP, CNN and GPT in fp32 and bf16 on the GPU and on the CPU with the same
#                 seed and data: the loss falls on the GPU, and step 1's loss and gradient
#                 norm (initial weights, first batch: no update yet) equal the CPU's within
#                 the tolerances below
#   checkpoint    --save, a stop (--exit-interval) and --resume auto on the GPU: the resumed
#                 steps equal the uninterrupted run's bit for bit, the checksums verify
#   metrics       --metrics-port while training on the device: communication seconds, memory,
#                 and NVML's tessera_gpu_* readings of the GPU
#   gemm          f32 and bf16 TFLOP/s through the tensor API against cuBLAS (benchmarks/gemm_cuda)
#   gemm small    the same for n = 64 and 256: microseconds per product and the host's time to
#                 queue one, against cublasGemmEx's (the per-call cost a decode step pays)
#   decode        tessera generate at batch 1, greedy, with and without the KV cache (--no-kv-cache):
#                 tokens/s after the prompt; both ways give the same tokens
#   gpt2-124m     a GPT-2-124M-shaped bf16 training step (12 layers, d 768, 12 heads, context
#                 1024, vocabulary 50304, synthetic data): tokens/s and MFU
# Prints one table at the end (part, PASS/FAIL/SKIP, key figure) and keeps
# every log, metrics file and the table under the output folder; exits 1 if
# any part failed.
#
#   run-gpu-suite.sh [--out DIR]        DIR default: ./tessera-gpu-results-<date>
#   run-gpu-suite.sh --device emu --quick
#       a rehearsal without a GPU: the emulated device (host memory, CPU kernels,
#       a GPU's rules) stands in for cuda:0, models and runs are small, and the
#       parts that need CUDA itself are skipped. The `gpu-bundle` test runs it.
#   Environment: TESSERA_PEAK_TFLOPS (the GPU's dense bf16 peak, when its name
#   is not in the table below), TESSERA_SUITE_GPT2_BATCH (default 8).
set -euo pipefail

bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=""
device=cuda
quick=0
usage() { sed -n '/^#   run-gpu-suite.sh \[--out/,/^#   is not in the table/p' "$0" | sed 's/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --out) out=${2:?--out needs a folder}; shift 2 ;;
    --device) device=${2:?--device needs cuda or emu}; shift 2 ;;
    --quick) quick=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "run-gpu-suite.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[[ $device == cuda || $device == emu ]] || { echo "run-gpu-suite.sh: --device is cuda or emu" >&2; exit 2; }
[[ -n $out ]] || out=$PWD/tessera-gpu-results-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"/logs "$out"/runs "$out"/data
out=$(cd "$out" && pwd)
export GTEST_COLOR=no
if ((EUID == 0)); then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

# ---------------------------------------------------------------------------
# Results and running with deadlines.
# ---------------------------------------------------------------------------
names=() results=() figures=()
record() {  # record PART PASS|FAIL|SKIP FIGURE
  names+=("$1"); results+=("$2"); figures+=("$3")
  printf '%-22s %-4s  %s\n' "$1" "$2" "$3"
}
# run LOG SECONDS COMMAND...: runs it with its output in logs/LOG.log; returns its exit status (124: deadline).
run() {
  local log=$out/logs/$1.log seconds=$2 rc=0
  shift 2
  { echo "\$ $*"; echo; } >>"$log"
  timeout --kill-after=15 "$seconds" "$@" >>"$log" 2>&1 || rc=$?
  if ((rc == 124 || rc == 137)); then echo "(stopped at its deadline of $seconds s)" >>"$log"; fi
  return $rc
}
why() {  # why RC SECONDS: a few words on a non-zero exit status
  case $1 in
    124|137) echo "deadline of $2 s passed" ;;
    132) echo "SIGILL: the processor lacks an instruction the build uses" ;;
    134) echo "aborted" ;;
    139) echo "segmentation fault" ;;
    *) echo "exit $1" ;;
  esac
}

# JSON lines of `tessera train --metrics`: field KEY of the train record of STEP ("" if none).
metric() {  # metric FILE STEP KEY
  awk -v step="$2" -v key="$3" '
    function field(line, k,   m) {
      if (match(line, "\"" k "\":[^,}]*")) { m = substr(line, RSTART + length(k) + 3, RLENGTH - length(k) - 3); gsub(/"/, "", m); return m }
      return ""
    }
    index($0, "\"kind\":\"train\"") && field($0, "step") == step { print field($0, key); exit }' "$1" 2>/dev/null || true
}
# The train records' KEY, one per line, in step order.
metric_column() {  # metric_column FILE KEY
  awk -v key="$2" '
    index($0, "\"kind\":\"train\"") && match($0, "\"" key "\":[^,}]*") {
      print substr($0, RSTART + length(key) + 3, RLENGTH - length(key) - 3) }' "$1" 2>/dev/null || true
}
relative() { awk -v a="$1" -v b="$2" 'BEGIN { d = a - b; if (d < 0) d = -d; s = b < 0 ? -b : b; if (s < 1e-30) s = 1e-30; printf "%.2g", d / s }'; }
within() { awk -v r="$1" -v t="$2" 'BEGIN { exit !(r <= t) }'; }

echo "Tessera GPU suite: bundle $bundle, device $device$( ((quick)) && echo ", quick"), results in $out"
echo

# ---------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------
env_rc=0
# shellcheck source=gpu-bundle-env.sh
source "$bundle/env.sh" >"$out/logs/environment.log" 2>&1 || env_rc=$?
cat "$out/logs/environment.log"
echo
if ((env_rc == 0)); then
  record environment PASS "glibc $(getconf GNU_LIBC_VERSION | awk '{print $2}'), CUDA libraries found$([[ -n ${TESSERA_BUNDLE_DRIVER:-} ]] && echo ", driver found" || echo ", no driver")"
else
  record environment FAIL "$(grep -c PROBLEM "$out/logs/environment.log") problem(s): $(grep PROBLEM "$out/logs/environment.log" | head -1 | sed 's/^env.sh: PROBLEM: //' | cut -c1-90)"
fi
if [[ -n ${TESSERA_BUNDLE_CPU_MISSING:-} ]]; then
  echo "run-gpu-suite.sh: this processor lacks ${TESSERA_BUNDLE_CPU_MISSING}: every program of the bundle would die with SIGILL; stopping." >&2
  printf '%s\n' "environment FAIL processor lacks ${TESSERA_BUNDLE_CPU_MISSING}" >"$out/summary.txt"
  exit 1
fi
tessera=$bundle/bin/tessera

# ---------------------------------------------------------------------------
# version: the device and the libraries as Tessera sees them
# ---------------------------------------------------------------------------
gpu_name=""
rc=0; run version 60 "$tessera" --version || rc=$?
if ((rc != 0)); then
  record version FAIL "tessera --version: $(why $rc 60); see logs/version.log"
else
  gpu_name=$(grep -o 'cuda:0 [^;]*' "$out/logs/version.log" | head -1 | sed 's/^cuda:0 //; s/ sm_[0-9]*.*//' || true)
  libs=$(grep -o 'cuBLAS [0-9.]*, cuDNN [0-9.]*' "$out/logs/version.log" | head -1 || true)
  nccl=$(grep -o 'NCCL [0-9.]*' "$out/logs/version.log" | head -1 || true)
  if [[ $device == emu ]]; then
    record version PASS "no GPU needed (emu); $libs, $nccl"
  elif [[ -n $gpu_name ]]; then
    record version PASS "$gpu_name; $libs, $nccl"
  else
    record version FAIL "no CUDA device seen: $(grep -o 'cuda: runtime[^;]*' "$out/logs/version.log" | head -1)"
  fi
fi

# ---------------------------------------------------------------------------
# gpu tests: GoogleTest's *.Gpu* cases of each packed binary
# ---------------------------------------------------------------------------
gtest_counts() {  # "P passed, S skipped, F failed" from a GoogleTest log
  local log=$1 passed skipped failed
  passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$log" | tail -1 || true)
  skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$log" | tail -1 || true)
  failed=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$log" | tail -1 || true)
  echo "${passed:-0} ${skipped:-0} ${failed:-0}"
}
# gtest_part PART LOG SECONDS COMMAND...: PASS when it exits 0 with tests run and none skipped.
# (On a GPU machine a skipped GPU test is a test that did not run: it counts as a failure.)
gtest_part() {
  local part=$1 log=$2 seconds=$3 rc=0 passed skipped failed
  shift 3
  run "$log" "$seconds" "$@" || rc=$?
  read -r passed skipped failed < <(gtest_counts "$out/logs/$log.log")
  local figure="$passed passed, $skipped skipped, $failed failed"
  if ((rc == 0 && failed == 0 && skipped == 0 && passed > 0)); then
    record "$part" PASS "$figure"
  else
    local first
    first=$(grep -E '^\[  (FAILED|SKIPPED) \] [A-Za-z]' "$out/logs/$log.log" | head -1 | sed 's/^\[ *[A-Z]* *\] //' || true)
    ((rc == 0)) || figure+="; $(why $rc "$seconds")"
    record "$part" FAIL "$figure${first:+; first: $first}"
  fi
}
if [[ $device == emu ]]; then
  record "gpu tests" SKIP "need a CUDA device"
else
  gtest_part "gpu tests: kernels" gpu-tests-kernels 900 "$bundle/bin/tessera_kernel_tests" --gtest_filter='*.Gpu*'
  gtest_part "gpu tests: core" gpu-tests-core 600 "$bundle/bin/tessera_core_tests" --gtest_filter='*.Gpu*'
  gtest_part "gpu tests: ckpt,loader" gpu-tests-infra 600 "$bundle/bin/tessera_infra_tests" --gtest_filter='*.Gpu*'
fi

# ---------------------------------------------------------------------------
# nccl 1 rank: the device-channel tests under mpirun (emu: the emulated channel)
# ---------------------------------------------------------------------------
if [[ $device == emu ]]; then
  mpi_part="mpi 1 rank (emu)" mpi_filter='*Emulated*'
else
  mpi_part="nccl 1 rank" mpi_filter='*Nccl*:*.Gpu*'
fi
gtest_part "$mpi_part" nccl-1-rank 300 "$bundle/bin/mpirun" -np 1 --bind-to none \
  "$bundle/bin/tessera_mpi_tests" --gtest_filter="$mpi_filter"

# ---------------------------------------------------------------------------
# selfcheck
# ---------------------------------------------------------------------------
rc=0; run selfcheck 300 "$tessera" selfcheck || rc=$?
ops=$(grep -c '^selfcheck op=' "$out/logs/selfcheck.log" || true)
compared=$(grep '^selfcheck op=' "$out/logs/selfcheck.log" | grep -c 'gpu vs cpu' || true)
failed_ops=$(grep '^selfcheck op=' "$out/logs/selfcheck.log" | grep 'status=FAIL' | sed 's/.*op=\([^ ]*\).*/\1/' | tr '\n' ' ' || true)
if ((rc != 0)); then
  record selfcheck FAIL "$(why $rc 300); failed: ${failed_ops:-see logs/selfcheck.log}"
elif [[ $device == emu ]]; then
  record selfcheck PASS "$ops ops, CPU only (no CUDA device)"
elif ((ops > 0 && compared == ops)); then
  record selfcheck PASS "$ops ops, backward and cuda:0 vs CPU"
else
  record selfcheck FAIL "$compared of $ops ops compared with the GPU"
fi

# ---------------------------------------------------------------------------
# prepare: the datasets of the training runs
# ---------------------------------------------------------------------------
fm_h5=""; text_h5=""
prepare_notes=()
if [[ -f $bundle/data/fashion-mnist/t10k-images-idx3-ubyte.gz ]]; then
  if run prepare 300 "$tessera" prepare idx --images "$bundle/data/fashion-mnist/t10k-images-idx3-ubyte.gz" \
      --labels "$bundle/data/fashion-mnist/t10k-labels-idx1-ubyte.gz" -o "$out/data/fashion-mnist-t10k.h5"; then
    fm_h5=$out/data/fashion-mnist-t10k.h5
  else
    prepare_notes+=("Fashion-MNIST failed")
  fi
fi
if compgen -G "$bundle/data/fortunes/*" >/dev/null; then
  if run prepare 300 "$tessera" prepare text -o "$out/data/fortunes.h5" "$bundle"/data/fortunes/*; then
    text_h5=$out/data/fortunes.h5
  else
    prepare_notes+=("fortunes failed")
  fi
fi
if ((${#prepare_notes[@]})); then
  record prepare FAIL "${prepare_notes[*]}; see logs/prepare.log"
elif [[ -n $fm_h5 && -n $text_h5 ]]; then
  record prepare PASS "Fashion-MNIST t10k, fortunes ($(du -h "$text_h5" | cut -f1))"
else
  record prepare SKIP "no data in the bundle: --synthetic data instead"
fi

# ---------------------------------------------------------------------------
# train: each model and precision on the device and on the CPU
# ---------------------------------------------------------------------------
# Tolerances for step 1 (the initial weights on the first batch, before any
# update), relative to the CPU's figure:
#   fp32: the GPU runs the same f32 arithmetic (cuBLASLt with
#     CUBLAS_COMPUTE_32F, no TF32; cuDNN convolutions with FMA math, no TF32)
#     in another summation order, and its expf/logf differ from glibc's by an
#     ulp or two. A dot product of length K then differs by about sqrt(K)
#     f32 ulps (u = 6e-8): 1e-6 for K = 1024, a few times that after the
#     layers and the mean over the batch. 1e-4 is 20x that; a wrong kernel
#     moves the loss or the gradient norm by 1e-2 or more.
#   bf16: operands and activations are rounded to bf16 (u = 3.9e-3) after
#     every layer, and where the two summation orders land on either side of
#     a rounding boundary the element differs by a whole bf16 ulp; the loss is
#     a mean over thousands of such elements, whose differences have random
#     signs, and the gradient norm a sum over millions. 2e-2 (five bf16 ulps)
#     leaves room for the deepest model (the GPT: 4 blocks of 6 roundings).
# At initialisation the loss is close to ln(classes) whatever the kernels do,
# so the gradient norm, which every backward kernel feeds, is checked too.
tolerance_fp32=1e-4
tolerance_bf16=2e-2
if ((quick)); then steps=12; else steps=40; fi
common=(--seed 1234 --train-steps "$steps" --log-interval 10)
if [[ -n $fm_h5 ]]; then fm_data=(--data "$fm_h5"); else fm_data=(--synthetic); fi
if [[ -n $text_h5 ]]; then text_data=(--data "$text_h5"); else text_data=(--synthetic); fi
if ((quick)); then
  # shellcheck disable=SC2054  # (--hidden takes a comma-separated list)
  mlp_flags=(--model mlp --hidden 256,256 "${fm_data[@]}" --micro-batch-size 32 --lr 2e-3)
  cnn_flags=(--model cnn "${fm_data[@]}" --micro-batch-size 16 --lr 2e-3)
  gpt_flags=(--model gpt "${text_data[@]}" --vocab-size 256 --seq-length 64 --num-layers 2 --num-heads 2
    --hidden-size 64 --micro-batch-size 4 --lr 3e-3 --warmup-steps 2 --hidden-dropout 0)
else
  # shellcheck disable=SC2054
  mlp_flags=(--model mlp --hidden 1024,1024 "${fm_data[@]}" --micro-batch-size 128 --lr 1e-3)
  cnn_flags=(--model cnn "${fm_data[@]}" --micro-batch-size 128 --lr 1e-3)
  gpt_flags=(--model gpt "${text_data[@]}" --vocab-size 256 --seq-length 256 --num-layers 4 --num-heads 4
    --hidden-size 256 --micro-batch-size 16 --lr 1e-3 --warmup-steps 10 --hidden-dropout 0)
fi
train_part() {  # train_part MODEL PRECISION FLAGS...
  local model=$1 precision=$2 part="train $1 $2" dir=$out/runs/$1-$2 rc_dev=0 rc_cpu=0
  shift 2
  mkdir -p "$dir"
  run "train-$model-$precision-$device" 600 "$tessera" train "$@" "${common[@]}" --precision "$precision" \
    --device "$device" --metrics "$dir/$device.jsonl" || rc_dev=$?
  run "train-$model-$precision-cpu" 600 "$tessera" train "$@" "${common[@]}" --precision "$precision" \
    --device cpu --metrics "$dir/cpu.jsonl" || rc_cpu=$?
  if ((rc_dev != 0)); then
    record "$part" FAIL "$device run: $(why $rc_dev 600); $(grep -m1 -i 'error' "$out/logs/train-$model-$precision-$device.log" | cut -c1-80)"
    return
  fi
  if ((rc_cpu != 0)); then record "$part" FAIL "CPU run: $(why $rc_cpu 600); see logs/train-$model-$precision-cpu.log"; return; fi
  local first last_mean ms loss_cpu loss_dev norm_cpu norm_dev rel_loss rel_norm tol problems=()
  loss_dev=$(metric "$dir/$device.jsonl" 1 loss); loss_cpu=$(metric "$dir/cpu.jsonl" 1 loss)
  norm_dev=$(metric "$dir/$device.jsonl" 1 grad_norm); norm_cpu=$(metric "$dir/cpu.jsonl" 1 grad_norm)
  if [[ -z $loss_dev || -z $loss_cpu || -z $norm_dev || -z $norm_cpu ]]; then
    record "$part" FAIL "no step-1 loss or grad_norm in the metrics"; return
  fi
  # The loss falls: the mean of the last five steps below 0.9 x step 1's, every loss finite.
  first=$loss_dev
  last_mean=$(metric_column "$dir/$device.jsonl" loss | tail -5 | awk '{ s += $1; n++ } END { if (n) printf "%.4f", s / n }')
  if metric_column "$dir/$device.jsonl" loss | grep -qiE 'nan|inf'; then problems+=("non-finite loss"); fi
  awk -v a="$last_mean" -v b="$first" 'BEGIN { exit !(a < 0.9 * b) }' || problems+=("loss did not fall")
  [[ $precision == bf16 ]] && tol=$tolerance_bf16 || tol=$tolerance_fp32
  rel_loss=$(relative "$loss_dev" "$loss_cpu"); rel_norm=$(relative "$norm_dev" "$norm_cpu")
  within "$rel_loss" "$tol" || problems+=("step-1 loss off the CPU's by $rel_loss > $tol")
  within "$rel_norm" "$tol" || problems+=("step-1 grad norm off the CPU's by $rel_norm > $tol")
  ms=$(metric_column "$dir/$device.jsonl" ms_per_step | tail -n +3 | sort -g | awk '{ v[NR] = $1 } END { if (NR) printf "%.1f", v[int((NR + 1) / 2)] }')
  local figure
  figure=$(printf 'loss %.3f->%.3f; step 1 vs cpu: loss %s, |g| %s; %s ms/step' "$first" "$last_mean" "$rel_loss" "$rel_norm" "${ms:-?}")
  if ((${#problems[@]})); then
    record "$part" FAIL "$(IFS=';'; echo "${problems[*]}"); $figure"
  else
    record "$part" PASS "$figure"
  fi
}
for precision in fp32 bf16; do
  train_part mlp "$precision" "${mlp_flags[@]}"
  train_part cnn "$precision" "${cnn_flags[@]}"
  train_part gpt "$precision" "${gpt_flags[@]}"
done

# ---------------------------------------------------------------------------
# checkpoint: save, stop, resume on the device; the resumed steps equal the uninterrupted run's
# ---------------------------------------------------------------------------
ck=$out/runs/checkpoint
rm -rf "$ck"; mkdir -p "$ck"
half=$((steps / 2))
ck_flags=("${mlp_flags[@]}" --seed 99 --train-steps "$steps" --log-interval 10 --device "$device")
rc=0
run checkpoint 300 "$tessera" train "${ck_flags[@]}" --save "$ck/whole" --metrics "$ck/whole.jsonl" || rc=$?
((rc != 0)) || run checkpoint 300 "$tessera" train "${ck_flags[@]}" --save "$ck/split" --exit-interval "$half" \
  --metrics "$ck/first-half.jsonl" || rc=$?
((rc != 0)) || run checkpoint 300 "$tessera" train "${ck_flags[@]}" --save "$ck/split" --resume auto \
  --metrics "$ck/second-half.jsonl" || rc=$?
((rc != 0)) || run checkpoint 120 "$tessera" checkpoint inspect "$ck/split/$(printf 'step_%08d' "$steps")" || rc=$?
if ((rc != 0)); then
  record checkpoint FAIL "$(why $rc 300); see logs/checkpoint.log"
else
  differing=0 compared=0
  for ((s = half + 1; s <= steps; ++s)); do
    a=$(metric "$ck/whole.jsonl" "$s" loss); b=$(metric "$ck/second-half.jsonl" "$s" loss)
    compared=$((compared + 1))
    [[ -n $a && $a == "$b" ]] || differing=$((differing + 1))
  done
  first_resumed=$(metric_column "$ck/second-half.jsonl" step | head -1)
  if ((differing == 0)) && [[ $first_resumed == $((half + 1)) ]] && grep -q 'checksums: all .* verified' "$out/logs/checkpoint.log"; then
    record checkpoint PASS "stopped at $half, resumed at $first_resumed: $compared losses bit-identical, checksums ok"
  else
    record checkpoint FAIL "resumed at step ${first_resumed:-?} (want $((half + 1))); $differing of $compared losses differ from the uninterrupted run"
  fi
fi

# ---------------------------------------------------------------------------
# metrics: --metrics-port on the device; /metrics read while it trains: communication
# seconds, memory, and on a GPU NVML's tessera_gpu_* readings (the part no CPU machine runs)
# ---------------------------------------------------------------------------
fetch_metrics() {  # fetch_metrics PORT: GET /metrics through bash's /dev/tcp (no curl needed)
  (exec 3<>"/dev/tcp/127.0.0.1/$1" && printf 'GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n' >&3 && cat <&3) 2>/dev/null || true
}
mport=$((19500 + $$ % 500))
mlog=$out/logs/metrics.log
"$tessera" train "${mlp_flags[@]}" --train-steps 100000 --log-interval 5 --device "$device" \
  --metrics-port "$mport" >"$mlog" 2>&1 &
mpid=$!
scraped=""
for _ in $(seq 120); do
  sleep 1
  scraped=$(fetch_metrics "$mport")
  grep -q '^tessera_step{' <<<"$scraped" && break
  kill -0 "$mpid" 2>/dev/null || break
done
kill -USR1 "$mpid" 2>/dev/null || true
wait "$mpid" || true
printf '%s\n' "$scraped" >"$out/logs/metrics-scrape.txt"
gpu_util=$(sed -n 's/^tessera_gpu_utilization_ratio{.*} \(.*\)/\1/p' <<<"$scraped" | head -1)
gpu_mem=$(sed -n 's/^tessera_gpu_memory_used_bytes{.*} \(.*\)/\1/p' <<<"$scraped" | head -1)
gpu_watts=$(sed -n 's/^tessera_gpu_power_watts{.*} \(.*\)/\1/p' <<<"$scraped" | head -1)
if ! grep -q '^tessera_comm_seconds_total{' <<<"$scraped" || ! grep -q '^tessera_memory_allocated_bytes{' <<<"$scraped"; then
  record metrics FAIL "no tessera_comm_seconds_total or tessera_memory_allocated_bytes at :$mport/metrics; see logs/metrics.log"
elif [[ $device == emu ]]; then
  record metrics PASS "served (emu: no NVML, no tessera_gpu_* series)"
elif [[ -z $gpu_util || -z $gpu_mem ]]; then
  record metrics FAIL "no tessera_gpu_utilization_ratio / memory_used_bytes from NVML; see logs/metrics-scrape.txt"
else
  record metrics PASS "NVML: utilisation $gpu_util, memory used $gpu_mem B, power ${gpu_watts:-?} W"
fi

# ---------------------------------------------------------------------------
# gemm: TFLOP/s through the tensor API against cuBLAS
# ---------------------------------------------------------------------------
if [[ $device == emu ]]; then
  record gemm SKIP "needs a CUDA device"
elif [[ ! -x $bundle/bin/benchmarks/gemm_cuda ]]; then
  record gemm FAIL "bin/benchmarks/gemm_cuda is not in the bundle (built without CUDA?)"
else
  rc=0; run gemm 600 "$bundle/bin/benchmarks/gemm_cuda" --sizes 4096,8192 --dtypes f32,bf16 || rc=$?
  if ((rc != 0)); then
    record gemm FAIL "$(why $rc 600); see logs/gemm.log"
  else
    g=$out/logs/gemm.log
    pick() { sed -n "s/^gemm_cuda n=$1 dtype=$2 $3=\([0-9.e+-]*\).*/\1/p" "$g" | head -1 || true; }
    figure="bf16 n=8192 $(pick 8192 bf16 'impl=tessera tflops') TFLOP/s vs cuBLAS $(pick 8192 bf16 'impl=cublas tflops')"
    figure+=" ($(pick 8192 bf16 tessera_over_cublas)x); f32 $(pick 8192 f32 'impl=tessera tflops') vs $(pick 8192 f32 'impl=cublas tflops')"
    bad_diff=$(awk '/rel_diff=/ { split($0, a, "rel_diff="); if (a[2] + 0 > 1e-2) print $2 " " $3 }' "$g" | head -1 || true)
    if [[ -n $bad_diff ]]; then
      record gemm FAIL "Tessera's product differs from cuBLAS's at $bad_diff; $figure"
    else
      record gemm PASS "$figure"
    fi
  fi
fi

# ---------------------------------------------------------------------------
# gemm small: products whose cost is the host's per call (decode, small models)
# ---------------------------------------------------------------------------
if [[ $device == emu ]]; then
  record "gemm small" SKIP "needs a CUDA device"
elif [[ ! -x $bundle/bin/benchmarks/gemm_cuda ]]; then
  record "gemm small" FAIL "bin/benchmarks/gemm_cuda is not in the bundle (built without CUDA?)"
else
  rc=0; run gemm-small 300 "$bundle/bin/benchmarks/gemm_cuda" --sizes 64,256 --dtypes bf16,f32 --calls 200 || rc=$?
  if ((rc != 0)); then
    record "gemm small" FAIL "$(why $rc 300); see logs/gemm-small.log"
  else
    g=$out/logs/gemm-small.log
    small() {  # small N DTYPE IMPL FIELD: FIELD's value on the line of that size, dtype and implementation
      awk -v n="n=$1" -v d="dtype=$2" -v i="impl=$3" -v k="$4=" '$2 == n && $3 == d && $4 == i {
        for (f = 5; f <= NF; ++f) if (index($f, k) == 1) { print substr($f, length(k) + 1); exit } }' "$g" || true
    }
    figure=""
    for n in 64 256; do
      figure+="${figure:+; }bf16 n=$n $(small $n bf16 tessera us_per_call) us/call (host $(small $n bf16 tessera host_us_per_call))"
      figure+=" vs cuBLAS $(small $n bf16 cublas us_per_call) (host $(small $n bf16 cublas host_us_per_call))"
    done
    bad_diff=$(awk '/rel_diff=/ { split($0, a, "rel_diff="); if (a[2] + 0 > 1e-2) print $2 " " $3 }' "$g" | head -1 || true)
    if [[ -n $bad_diff ]]; then
      record "gemm small" FAIL "Tessera's product differs from cuBLAS's at $bad_diff; $figure"
    elif [[ -z $(small 64 bf16 tessera us_per_call) ]]; then
      record "gemm small" FAIL "no us_per_call lines in logs/gemm-small.log"
    else
      record "gemm small" PASS "$figure"
    fi
  fi
fi

# ---------------------------------------------------------------------------
# decode: tessera generate at batch 1 with and without the KV cache
# ---------------------------------------------------------------------------
# A GPT of the given shape trained for one step (the weights' values do not
# change the cost), then the same greedy generation twice. Greedy decoding
# with and without the cache computes the same logits in another order (f32:
# differences of ulps), so the tokens agree unless two logits tie to within
# that, which random weights make rare; a kernel that is wrong changes them at once.
decode=$out/runs/decode
rm -rf "$decode"; mkdir -p "$decode"
if ((quick)); then
  decode_vocab=256 decode_prompt=8 decode_new=40
  decode_model=(--num-layers 2 --hidden-size 64 --num-heads 2 --seq-length 64)
  decode_shape="2 layers, d 64"
else
  decode_vocab=50304 decode_prompt=64 decode_new=448
  decode_model=(--num-layers 12 --hidden-size 768 --num-heads 12 --seq-length 1024)
  decode_shape="GPT-2-124M shape"
fi
decode_ids=$(seq 0 $((decode_prompt - 1)) | awk -v v="$decode_vocab" '{ print (7 * $1 + 3) % v }' | paste -sd, -)
decode_rate() {  # decode_rate LOG: generate's tokens/s after the prompt
  sed -n 's/^generate: .*, then \([0-9.]*\) tokens\/s.*/\1/p' "$out/logs/$1.log" | tail -1 || true
}
decode_tokens() {  # decode_tokens LOG: the ids generate printed
  grep -E '^[0-9 ]+$' "$out/logs/$1.log" | tail -1 || true
}
rc=0
run decode-checkpoint 600 "$tessera" train --model gpt --synthetic --vocab-size "$decode_vocab" "${decode_model[@]}" \
  --micro-batch-size 1 --train-steps 1 --device "$device" --save "$decode/checkpoint" || rc=$?
generate_flags=("$decode/checkpoint" --prompt-ids "$decode_ids" --max-new-tokens "$decode_new" --temperature 0
  --print-ids --device "$device")
((rc != 0)) || run decode-cache-on 600 "$tessera" generate "${generate_flags[@]}" || rc=$?
((rc != 0)) || run decode-cache-off 600 "$tessera" generate "${generate_flags[@]}" --no-kv-cache || rc=$?
with_cache=$(decode_rate decode-cache-on) without_cache=$(decode_rate decode-cache-off)
if ((rc != 0)); then
  record decode FAIL "$(why $rc 600); see logs/decode-*.log"
elif [[ -z $with_cache || -z $without_cache ]]; then
  record decode FAIL "no tokens/s in generate's output; see logs/decode-cache-on.log and logs/decode-cache-off.log"
else
  figure="KV cache $with_cache tokens/s, without $without_cache"
  figure+=" ($(awk -v a="$with_cache" -v b="$without_cache" 'BEGIN { printf "%.1f", (b > 0 ? a / b : 0) }')x);"
  figure+=" batch 1, $decode_new new tokens after $decode_prompt, $decode_shape"
  if [[ $(decode_tokens decode-cache-on) != "$(decode_tokens decode-cache-off)" ]]; then
    record decode FAIL "the tokens differ with and without the cache; $figure"
  else
    record decode PASS "$figure"
  fi
fi

# ---------------------------------------------------------------------------
# gpt2-124m: a GPT-2-124M-shaped bf16 training step: tokens/s and MFU
# ---------------------------------------------------------------------------
# MFU = 6 · parameters · tokens/s / peak (the usual 6N FLOPs per token of a
# forward and backward pass; attention's own FLOPs are left out, as PaLM's
# appendix B does for its 6N figure). Peak: dense bf16 tensor-core FLOP/s of
# the GPU named by the driver.
peak_tflops() {
  if [[ -n ${TESSERA_PEAK_TFLOPS:-} ]]; then echo "$TESSERA_PEAK_TFLOPS TESSERA_PEAK_TFLOPS"; return; fi
  case $1 in  # (GH200 before H200: its name contains "H200")
    *H100*NVL*) echo "835 H100 NVL" ;;
    *H100*PCIe*) echo "756 H100 PCIe" ;;
    *H100*) echo "989 H100 SXM" ;;
    *GH200*) echo "989 GH200" ;;
    *H200*NVL*) echo "835 H200 NVL" ;;
    *H200*) echo "989 H200 SXM" ;;
    *A100*) echo "312 A100" ;;
    *) echo "" ;;
  esac
}
gpt2=$out/runs/gpt2-124m
mkdir -p "$gpt2"
if ((quick)); then
  gpt2_flags=(--num-layers 2 --hidden-size 64 --num-heads 2 --seq-length 64 --vocab-size 512 --micro-batch-size 2 --train-steps 6)
else
  gpt2_flags=(--num-layers 12 --hidden-size 768 --num-heads 12 --seq-length 1024 --vocab-size 50304
    --micro-batch-size "${TESSERA_SUITE_GPT2_BATCH:-8}" --train-steps 30)
fi
rc=0
run gpt2-124m 600 "$tessera" train --model gpt --synthetic --precision bf16 --device "$device" "${gpt2_flags[@]}" \
  --lr 6e-4 --warmup-steps 2 --hidden-dropout 0 --log-interval 5 --metrics "$gpt2/metrics.jsonl" || rc=$?
if ((rc != 0)); then
  record gpt2-124m FAIL "$(why $rc 600); $(grep -m1 -i 'error' "$out/logs/gpt2-124m.log" | cut -c1-90)"
else
  params=$(sed -n 's/^model: gpt, \([0-9]*\) parameters.*/\1/p' "$out/logs/gpt2-124m.log" | head -1 || true)
  # The median over the steps after the first five (start-up, allocator warm-up, cuBLASLt heuristics).
  tokens=$(metric_column "$gpt2/metrics.jsonl" tokens_per_s | tail -n +6 | sort -g | awk '{ v[NR] = $1 } END { if (NR) printf "%.0f", v[int((NR + 1) / 2)] }')
  peak=""
  if [[ $device == cuda ]]; then peak=$(peak_tflops "$gpu_name"); fi
  if [[ -z $tokens || -z $params ]]; then
    record gpt2-124m FAIL "no tokens_per_s or parameter count in the run's output"
  elif [[ -z $peak ]]; then
    record gpt2-124m PASS "$params params, $tokens tokens/s; MFU: peak unknown for '${gpu_name:-$device}' (set TESSERA_PEAK_TFLOPS)"
  else
    mfu=$(awk -v n="$params" -v t="$tokens" -v p="${peak%% *}" 'BEGIN { printf "%.1f", 600 * n * t / (p * 1e12) }')
    record gpt2-124m PASS "$params params, $tokens tokens/s, MFU $mfu% of ${peak%% *} TFLOP/s (${peak#* } bf16 dense)"
  fi
fi

# ---------------------------------------------------------------------------
# The table.
# ---------------------------------------------------------------------------
failures=0
{
  echo "Tessera GPU suite: ${gpu_name:-$device}, $(date -u +%Y-%m-%dT%H:%M:%SZ), bundle $(sed -n 's/^source: //p' "$bundle/MANIFEST.txt" 2>/dev/null)"
  printf '%-22s %-6s %s\n' PART RESULT "KEY FIGURE"
  for i in "${!names[@]}"; do
    printf '%-22s %-6s %s\n' "${names[$i]}" "${results[$i]}" "${figures[$i]}"
    [[ ${results[$i]} != FAIL ]] || failures=$((failures + 1))
  done
  echo "$failures part(s) failed; logs in $out/logs, metrics in $out/runs"
} >"$out/summary.txt"
echo
cat "$out/summary.txt"
((failures == 0))
