#!/usr/bin/env bash
# CTest fixture of the `slurm` tests. `up`: installs Slurm and munge through
# scripts/install-deps.sh (quiet and a no-op when present), starts the
# single-host cluster of scripts/slurm-local.sh (two slurmd nodes n1, n2) in
# DIR, and prepares the Fashion-MNIST datasets the jobs train on in DATA.
# `down`: stops the daemons it started (and only those).
#   slurm_cluster.sh up|down SOURCE_DIR CLUSTER_DIR DATA_DIR TESSERA
set -euo pipefail
action=$1 source=$2 cluster=$3 data=$4 tessera=$5
case $action in
  up)
    "$source/scripts/install-deps.sh"
    "$source/scripts/slurm-local.sh" up "$cluster"
    source "$cluster/env"
    sinfo -N
    mkdir -p "$data"
    fm=/usr/share/datasets/fashion-mnist
    "$tessera" prepare idx --images $fm/train-images-idx3-ubyte.gz --labels $fm/train-labels-idx1-ubyte.gz \
      -o "$data/fashion-mnist-train.h5"
    "$tessera" prepare idx --images $fm/t10k-images-idx3-ubyte.gz --labels $fm/t10k-labels-idx1-ubyte.gz \
      -o "$data/fashion-mnist-test.h5"
    ;;
  down)
    "$source/scripts/slurm-local.sh" down "$cluster"
    ;;
  *) echo "usage: $0 up|down SOURCE_DIR CLUSTER_DIR DATA_DIR TESSERA" >&2; exit 2 ;;
esac
