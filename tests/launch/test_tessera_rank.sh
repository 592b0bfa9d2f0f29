#!/usr/bin/env bash
# tessera_rank_wrapper: scripts/tessera-rank as a launcher runs it, with the
# program it wraps replaced by a shell that prints what it was given. On the
# dgx8 fixture (TESSERA_SYSFS_ROOT) local rank 5 from mpirun's variables gets
# GPU 5 and mlx5_5:1 exported, an exported NCCL_IB_HCA is kept, Slurm's
# SLURM_LOCALID is used when mpirun's variables are absent, the summary line
# is printed by local rank 0 only; on this machine (/) the command really
# runs bound to the computed CPUs; a broken sysfs root stops the wrapper
# with tessera topo's error instead of starting the command.
#   test_tessera_rank.sh SOURCE_DIR TESSERA
set -euo pipefail
source=$1
export TESSERA_BIN=$2
source "$(dirname "$0")/launch_test_lib.sh"
wrapper=$source/scripts/tessera-rank
fixtures=$source/tests/fixtures/topology
out=$(mktemp) err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT
unset OMPI_COMM_WORLD_LOCAL_RANK OMPI_COMM_WORLD_LOCAL_SIZE SLURM_LOCALID MPI_LOCALRANKID PMIX_LOCAL_RANK \
  NCCL_IB_HCA CUDA_VISIBLE_DEVICES TESSERA_CPU_BIND

show='echo "gpu=$CUDA_VISIBLE_DEVICES hca=$NCCL_IB_HCA gdr=$NCCL_NET_GDR_LEVEL ifname=$NCCL_SOCKET_IFNAME"
      echo "ucx=$UCX_NET_DEVICES pml=$OMPI_MCA_pml bind=$TESSERA_CPU_BIND args=$*"'

# mpirun's variables, rank 5 of 8; the fixture's CPUs do not exist here, so no binding.
OMPI_COMM_WORLD_LOCAL_RANK=5 OMPI_COMM_WORLD_LOCAL_SIZE=8 TESSERA_SYSFS_ROOT=$fixtures/dgx8 TESSERA_CPU_BIND=none \
  "$wrapper" bash -c "$show" wrapped a1 "b 2" >"$out" 2>"$err"
expect_grep '^gpu=5 hca==mlx5_5:1 gdr=PIX ifname==eno1$' "$out" "rank 5's GPU and HCA"
expect_grep '^ucx=mlx5_5:1 pml=ucx bind=none args=a1 b 2$' "$out" "UCX, MPI and the arguments passed on"
[[ ! -s $err ]] || { cat "$err" >&2; fail "local rank 5 printed on stderr (only local rank 0 prints its summary)"; }

# Slurm's variable; an exported NCCL_IB_HCA wins over the computed one.
SLURM_LOCALID=2 NCCL_IB_HCA='=mlx5_7:1' TESSERA_SYSFS_ROOT=$fixtures/dgx8 TESSERA_CPU_BIND=none \
  "$wrapper" bash -c "$show" >"$out" 2>"$err"
expect_grep '^gpu=2 hca==mlx5_7:1 gdr=PIX ' "$out" "SLURM_LOCALID and the kept NCCL_IB_HCA"

# Local rank 0 prints the summary line on stderr.
SLURM_LOCALID=0 SLURMD_NODENAME=node17 TESSERA_SYSFS_ROOT=$fixtures/tcp-only TESSERA_CPU_BIND=none \
  "$wrapper" true >"$out" 2>"$err"
expect_grep '^tessera-rank: node17: local rank 0 of 4: GPU 0 \(0000:01:00.0, NUMA 0\); TCP on eth0; ' "$err" \
  "the summary of local rank 0"

# This machine: the command runs bound to the CPUs tessera topo computed.
OMPI_COMM_WORLD_LOCAL_RANK=0 OMPI_COMM_WORLD_LOCAL_SIZE=1 \
  "$wrapper" bash -c 'echo "bind=$TESSERA_CPU_BIND"; grep Cpus_allowed_list /proc/self/status' >"$out" 2>"$err"
bind=$(sed -n 's/^bind=//p' "$out")
[[ -n $bind ]] || fail "no TESSERA_CPU_BIND on this machine: $(cat "$out" "$err")"
expect_grep "^Cpus_allowed_list:[[:space:]]+$bind\$" "$out" "the command's CPU affinity"

# A sysfs root that does not exist: the wrapper fails and never starts the command.
if OMPI_COMM_WORLD_LOCAL_RANK=0 TESSERA_SYSFS_ROOT=/nonexistent/sysfs "$wrapper" touch "$out.started" 2>"$err"; then
  fail "the wrapper succeeded with a missing sysfs root"
fi
[[ ! -e $out.started ]] || fail "the wrapper started the command after tessera topo failed"
expect_grep "the sysfs root '/nonexistent/sysfs' is not a directory" "$err" "tessera topo's error"
expect_grep '^tessera-rank: .* failed' "$err" "the wrapper's own line"
echo "PASS: tessera-rank applies the topology decision, keeps exported settings, binds CPUs, and stops on errors"
