#!/usr/bin/env bash
# Makes the README's pictures of a running job from the real servers: a
# 2-rank GPT run on the fortunes text with --metrics-port and --mlflow-uri,
# Debian's Prometheus scraping it (its own graph page: loss, throughput and
# communication bytes per rank) and an MLflow server recording it (the run's
# page and the curves.svg artifact it received), each page shot by headless Chromium (Debian's
# `chromium`). Everything on loopback, stopped at the end.
#   scripts/observability-screenshots.sh [OUT_DIR (docs/images)] [SECONDS (90)]
# Needs: build/bin/tessera, scripts/install-deps.sh (prometheus, the MLflow
# venv), and `apt-get install chromium`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-docs/images}")
seconds=${2:-90}
tessera=$PWD/build/bin/tessera
mlflow=${TESSERA_TOOLS_DIR:-/opt/tessera-tools}/mlflow/bin/mlflow
for tool in "$tessera" "$mlflow" /usr/bin/prometheus /usr/bin/chromium; do
  [[ -x $tool ]] || { echo "observability-screenshots.sh: $tool is missing (see the header of this script)" >&2; exit 1; }
done
work=$(mktemp -d)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill -- -"$pid" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true

cat >"$work/prometheus.yml" <<YML
global: {scrape_interval: 2s, evaluation_interval: 2s}
scrape_configs:
  - job_name: tessera
    static_configs: [{targets: ['127.0.0.1:9500']}]
YML
setsid /usr/bin/prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address=127.0.0.1:9090 >"$work/prometheus.log" 2>&1 &
pids+=($!)
setsid "$mlflow" server --host 127.0.0.1 --port 5000 --workers 1 --backend-store-uri "sqlite:///$work/mlflow.db" \
  --artifacts-destination "$work/artifacts" >"$work/mlflow.log" 2>&1 &
pids+=($!)
for _ in $(seq 240); do
  curl -sf http://127.0.0.1:9090/-/ready >/dev/null && curl -sf http://127.0.0.1:5000/health >/dev/null && break
  sleep 0.5
done

(cd "$work" && "$tessera" prepare text -o fortunes.h5 --tokenizer bpe --vocab-size 2048 \
   $(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | sort) >/dev/null)
setsid mpirun -np 2 --oversubscribe --bind-to none "$tessera" train --model gpt --tp 2 \
  --data "$work/fortunes.h5" --eval-data "$work/fortunes.eval.h5" --vocab-size 2048 --seq-length 64 \
  --num-layers 2 --num-heads 4 --hidden-size 128 --micro-batch-size 8 --lr 3e-3 --warmup-steps 20 \
  --train-steps 100000 --eval-interval 50 --eval-iters 4 --threads 1 --log-interval 5 \
  --metrics-port 9500 --mlflow-uri http://127.0.0.1:5000 --mlflow-experiment fortunes \
  --mlflow-run-name "gpt tp2 fortunes" --metrics "$work/metrics.jsonl" >"$work/train.log" 2>&1 &
train=$!
pids+=($train)
sleep "$seconds"
kill -USR1 -- -"$train"  # every rank stops at the next step boundary: the run ends KILLED in MLflow
wait "$train" || true

shot() {  # URL FILE [WIDTHxHEIGHT]
  chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --force-device-scale-factor=1 \
    --window-size="${3:-1400,1000}" --virtual-time-budget=20000 --screenshot="$2" "$1" >/dev/null 2>&1
  echo "wrote $2"
}
range=$((seconds + 10))s
q() { python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1]))' "$1"; }
shot "http://127.0.0.1:9090/graph?g0.expr=$(q tessera_loss)&g0.tab=0&g0.range_input=$range&g1.expr=$(q tessera_tokens_per_second)&g1.tab=0&g1.range_input=$range&g2.expr=$(q 'rate(tessera_comm_bytes_total[30s])')&g2.tab=0&g2.range_input=$range" \
  "$out/prometheus-graph.png" 1400,2150
run=$(grep -o 'runs/[0-9a-f]*' "$work/train.log" | head -1 | cut -d/ -f2)
experiment=$(grep -o 'experiments/[0-9]*' "$work/train.log" | head -1 | cut -d/ -f2)
shot "http://127.0.0.1:5000/#/experiments/$experiment/runs/$run" "$out/mlflow-run.png" 1600,1100
shot "http://127.0.0.1:5000/#/experiments/$experiment/runs/$run/artifacts/curves.svg" "$out/mlflow-curves.png" 1600,1100
grep -E '^(done|mlflow)' "$work/train.log" || { cat "$work/train.log" >&2; exit 1; }
