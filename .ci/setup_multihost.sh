#!/usr/bin/env bash
# Install what test_multihost.py needs: iproute2 (network namespaces), util-linux (unshare),
# and SLURM (slurm-wlm: slurmctld, slurmd, sbatch) with munge. Debian/Ubuntu, as root.
#
# Idempotent and quiet: when every tool is already there it does nothing and prints one
# line. It only installs: the packages' own services are not started (a temporary
# policy-rc.d refuses them), because the tests start private daemons of their own.
# Not root, or no apt-get: prints why and exits 0 (the tests then skip, saying why).
# A failed install exits 1 with apt's log.
set -euo pipefail

need=(ip unshare munged munge slurmctld slurmd sbatch srun scontrol sinfo scancel)
missing=()
for tool in "${need[@]}"; do
    command -v "$tool" > /dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "setup_multihost: iproute2, slurm-wlm and munge already installed"
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get > /dev/null 2>&1; then
    echo "setup_multihost: missing ${missing[*]}; not root or no apt-get, so not installing" \
         "(test_multihost.py will skip)"
    exit 0
fi

log=$(mktemp)
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && own_policy=1
fi
cleanup() {
    if [ "$own_policy" -eq 1 ]; then rm -f "$policy"; fi
    rm -f "$log"
}
trap cleanup EXIT

apt() {
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get -qq -o DPkg::Lock::Timeout=120 "$@" \
        >> "$log" 2>&1
}
start=$SECONDS
if ! { apt update && apt install -y --no-install-recommends iproute2 util-linux munge slurm-wlm; }; then
    echo "setup_multihost: apt-get failed installing iproute2 util-linux munge slurm-wlm:" >&2
    tail -n 30 "$log" >&2
    exit 1
fi
echo "setup_multihost: installed iproute2 util-linux munge slurm-wlm ($((SECONDS - start)) s;" \
     "was missing: ${missing[*]})"
