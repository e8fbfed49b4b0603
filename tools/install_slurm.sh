#!/usr/bin/env bash
# Install the Debian packages the `slurm` and `two_nodes` tests need: SLURM's controller,
# node daemon and client commands (tests/slurm_cluster.py runs them with a generated
# configuration), and iproute2 for network namespaces (tools/simulator_validation/netns.py).
# Idempotent; does nothing when everything is there. Needs root (or sudo) and apt.
set -euo pipefail

need=()
command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || need+=(slurmd)
command -v sbatch >/dev/null 2>&1 || need+=(slurm-client)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v tc >/dev/null 2>&1 || need+=(iproute2)
if [ ${#need[@]} -eq 0 ]; then
  echo "install_slurm: slurmctld, slurmd, sbatch, ip and tc already installed"
  exit 0
fi
SUDO=
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO=sudo; else
    echo "install_slurm: not root and no sudo; cannot install ${need[*]}" >&2; exit 1
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_slurm: no apt-get; install ${need[*]} by hand" >&2; exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# The packages' own services are not started (no systemd in containers; the tests run
# their own daemons with their own configuration).
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
echo "install_slurm: installed ${need[*]}"
