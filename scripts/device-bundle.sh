#!/usr/bin/env bash
# device-bundle.sh: prepare .device/ (git-ignored) for the GPU host, which has
# no Go: stripped test binaries built here and a copy of the test model.
#   .device/bin/native.test   op parity (TestCUDAOpsParity), matvec benchmark
#   .device/bin/engine.test   golden, split, batch and status checks on CUDA
#   .device/bin/meshgpu.gz    the CLI (gzipped: 27 MiB stripped, 11 gzipped; the
#                             device check unpacks it), for `meshgpu bench hops`
#                             on the host's CPUs and `meshgpu bench streams` on the GPU
#   .device/models/gocoder-6m the shared test model (../shared does not travel)
#   .device/shared/models/gocoder-6m-gguf/gocoder-6m-q4_k_m.gguf  llama.cpp's
#                             Q4_K_M file of it (3.5 MiB), for the quant step
#                             (MESHGPU_SHARED=.device/shared there)
# Then run on the device: `bash scripts/device-check.sh` with carry [".device"]
# (docs/device-check.md).
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${MESHGPU_SHARED:-../shared}
model="$shared/models/gocoder-6m"
[ -f "$model/model.safetensors" ] || { echo "device-bundle: $model not found (set MESHGPU_SHARED)" >&2; exit 1; }

rm -rf .device
mkdir -p .device/bin .device/models
export CGO_ENABLED=1
for pkg in native engine; do
  echo "device-bundle: go test -c ./$pkg"
  go test -c -ldflags='-s -w' -o ".device/bin/$pkg.test" "./$pkg"
done
echo "device-bundle: go build ./cmd/meshgpu"
go build -ldflags='-s -w' -o .device/bin/meshgpu ./cmd/meshgpu
gzip -9 .device/bin/meshgpu
cp -r "$model" .device/models/gocoder-6m
mkdir -p .device/shared/models/gocoder-6m-gguf
cp "$shared/models/gocoder-6m-gguf/gocoder-6m-q4_k_m.gguf" .device/shared/models/gocoder-6m-gguf/
chmod -R u+w .device/models .device/shared
git rev-parse HEAD > .device/commit 2>/dev/null || true
git status --short > .device/status 2>/dev/null || true
size=$(du -sm .device | cut -f1)
echo "device-bundle: .device is ${size} MiB (the whole transfer must stay under 64 MiB)"
if [ "$size" -gt 48 ]; then
  echo "device-bundle: .device is too large for the device transfer" >&2
  exit 1
fi
