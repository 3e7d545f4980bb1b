#!/usr/bin/env bash
# Installs Debian's nvidia-cuda-toolkit (nvcc 11.8, non-free) and cmake, so
# the CUDA kernels can be compile-checked on a machine without a GPU.
set -euo pipefail
if command -v nvcc >/dev/null 2>&1 && command -v cmake >/dev/null 2>&1; then
	exit 0
fi
src=/etc/apt/sources.list.d/debian.sources
if [ -f "$src" ] && ! grep -q 'non-free' "$src"; then
	sed -i 's/^Components: main$/Components: main contrib non-free non-free-firmware/' "$src"
fi
if [ -f /etc/apt/sources.list ] && grep -q '^deb .* main$' /etc/apt/sources.list; then
	sed -i 's/^\(deb .* main\)$/\1 contrib non-free non-free-firmware/' /etc/apt/sources.list
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends nvidia-cuda-toolkit cmake >/dev/null
nvcc --version | tail -1
