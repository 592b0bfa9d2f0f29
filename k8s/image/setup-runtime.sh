#!/bin/sh
# Run once while building either image (Dockerfile, Dockerfile.cpu): the
# Debian packages Tessera runs with (Open MPI, HDF5, oneDNN, OpenBLAS, toml++, PCRE2), sshd
# and ssh for the MPI Operator's launcher-to-worker ssh, procps for the
# workers' preStop hook (pkill/pgrep), the fortunes text (the manifests'
# training data), and the non-root user mpiuser (uid 1000) that the manifests
# run as. ssh goes to port 2222 without host-key checks: the workers' host key
# is the per-job key the operator generates, known to no one beforehand.
set -eu
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends \
  openmpi-bin libopenmpi3 libhdf5-103-1 libdnnl2 libopenblas0-openmp libgomp1 libtomlplusplus3 libpcre2-8-0 libcpp-httplib0.11 \
  openssh-server openssh-client procps util-linux fortunes ca-certificates
rm -rf /var/lib/apt/lists/*

useradd --uid 1000 --user-group --create-home --shell /bin/bash mpiuser
# The distribution's host keys are not used (tessera-sshd uses the job's key).
rm -f /etc/ssh/ssh_host_*
# Privilege separation directory, for sshd run as root (the RDMA overlays).
mkdir -p /run/sshd
cat >/etc/ssh/ssh_config.d/tessera.conf <<'CONFIG'
Host *
    Port 2222
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    ConnectionAttempts 10
CONFIG
