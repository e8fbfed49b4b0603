#!/usr/bin/env bash
# Install what tests/test_docker.py needs: Debian's docker.io (dockerd, containerd, runc and a
# docker CLI with BuildKit) and debootstrap. Does nothing when they are already there.
# Never fails the caller: if they cannot be installed, it says why and the test skips itself.
set -uo pipefail
if command -v dockerd >/dev/null && command -v debootstrap >/dev/null && [ -x /usr/bin/docker ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "install_docker: no apt-get here; install docker.io and debootstrap by hand (the docker test skips)" >&2
  exit 0
fi
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
export DEBIAN_FRONTEND=noninteractive
if ! { timeout 600 $SUDO apt-get -o DPkg::Lock::Timeout=300 update -qq &&
       timeout 900 $SUDO apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends docker.io debootstrap; } >/tmp/install_docker.log 2>&1; then
  echo "install_docker: could not install docker.io/debootstrap (the docker test skips): $(tail -n 1 /tmp/install_docker.log)" >&2
fi
exit 0
