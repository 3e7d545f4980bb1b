#!/usr/bin/env bash
# docker-test.sh (`make docker-test`, run by .ci/run): build the images from
# local bases made of Debian packages (scripts/docker-bases.sh) and run the
# container checks (e2e/docker): a node answers a chat completion, keeps its
# peer id across a restart, is healthy, downloads --model org/name into its
# volume; `demo --once` and `--version`.
#
#   meshgpu:cpu  Dockerfile       bases: the local Debian image
#   meshgpu      Dockerfile.cuda  bases: the local Debian image, and the local
#                                 CUDA 11.8 runtime (Debian non-free)
#
# The binary and the CUDA library are built here by the make targets CI runs
# (`make build`; `make cuda` into the kernels-check build folder, which
# .ci/run has just built) and enter the builds through docker/prebuilt/
# (PREBUILT_BIN=1, PREBUILT_LIB=1): compiling Go inside Docker from a cold
# cache takes minutes on these machines. DOCKER_TEST_COMPILE=1 compiles the
# binary inside Docker instead, in the local Go base (scripts/docker-bases.sh go).
# Without nvcc the CUDA image is skipped (an error under CI=true).
# Timings and the image sizes are printed at the end (docs/docker.md).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"

DEBIAN_IMAGE=${DEBIAN_IMAGE:-meshgpu-local/debian:bookworm-slim}
CUDA_IMAGE=${CUDA_IMAGE:-meshgpu-local/cuda:11.8-runtime-bookworm}
GO_IMAGE=${GO_IMAGE:-meshgpu-local/golang:1.26-bookworm}
CPU_TAG=${CPU_TAG:-meshgpu:cpu}
CUDA_TAG=${CUDA_TAG:-meshgpu}
CUDA_BUILD_DIR=${CUDA_BUILD_DIR:-build/cuda-check}
export DEBIAN_IMAGE CUDA_IMAGE GO_IMAGE

say() { echo "docker-test: $*" >&2; }
timings=()
timed() { # timed LABEL CMD...: run, and note how long it took
  local label=$1 t0=$SECONDS
  shift
  "$@"
  timings+=("$label: $((SECONDS - t0)) s")
}
# image_build LOG ARGS...: docker build, its output in LOG (shown on failure).
image_build() {
  local log=$1
  shift
  docker build "$@" >"$log" 2>&1 || { tail -40 "$log" >&2; say "docker build failed (all of it in $log)"; exit 1; }
}
logs=build/docker-test
mkdir -p "$logs"

cuda=1
if ! command -v nvcc >/dev/null; then
  [ "${CI:-}" != true ] || { say "nvcc not found (CI installs it: scripts/install-cuda-toolkit.sh)"; exit 1; }
  say "nvcc not found: skipping the CUDA image"
  cuda=""
fi

bases=(debian)
[ -z "$cuda" ] || bases+=(cuda)
[ -z "${DOCKER_TEST_COMPILE:-}" ] || bases+=(go)
timed "bases (${bases[*]})" bash scripts/docker-bases.sh "${bases[@]}"

# Without buildx the CLI's legacy builder is what there is; say so once,
# not in a warning per build.
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0

version=$(git describe --tags --always --dirty 2>/dev/null || echo devel)
rm -f docker/prebuilt/meshgpu docker/prebuilt/libmeshgpu_cuda.so
args=(--force-rm --network host --build-arg VERSION="$version")
if [ -n "${DOCKER_TEST_COMPILE:-}" ]; then
  args+=(--build-arg GO_IMAGE="$GO_IMAGE")
else
  timed "make build (host)" make build VERSION="$version"
  cp bin/meshgpu docker/prebuilt/meshgpu
  args+=(--build-arg GO_IMAGE="$DEBIAN_IMAGE" --build-arg PREBUILT_BIN=1)
fi
if [ -n "$cuda" ]; then
  timed "make cuda (host, $CUDA_BUILD_DIR)" make cuda CUDA_BUILD_DIR="$CUDA_BUILD_DIR" >/dev/null
  cp "$CUDA_BUILD_DIR/libmeshgpu_cuda.so" docker/prebuilt/libmeshgpu_cuda.so
  if command -v cuobjdump >/dev/null; then # the image's library runs on A100, L40/4090, H100/H200
    have=$(cuobjdump --list-elf docker/prebuilt/libmeshgpu_cuda.so | grep -o 'sm_[0-9]*' | sort -u | tr '\n' ' ')
    for a in sm_80 sm_89 sm_90; do
      case " $have" in *" $a "*) ;; *) say "libmeshgpu_cuda.so has no $a code (has: $have)"; exit 1 ;; esac
    done
    say "libmeshgpu_cuda.so: $have($(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/nvcc \1/p'))"
  fi
fi

timed "docker build $CPU_TAG" image_build "$logs/build-cpu.log" "${args[@]}" --build-arg RUNTIME_IMAGE="$DEBIAN_IMAGE" \
  -f Dockerfile -t "$CPU_TAG" .
if [ -n "$cuda" ]; then
  timed "docker build $CUDA_TAG" image_build "$logs/build-cuda.log" "${args[@]}" --build-arg PREBUILT_LIB=1 \
    --build-arg CUDA_DEVEL_IMAGE="$DEBIAN_IMAGE" --build-arg CUDA_RUNTIME_IMAGE="$CUDA_IMAGE" \
    -f Dockerfile.cuda -t "$CUDA_TAG" .
fi

export MESHGPU_DOCKER_TEST=1 MESHGPU_DOCKER_VERSION="$version" MESHGPU_DOCKER_CPU_IMAGE="$CPU_TAG"
if [ -n "$cuda" ]; then export MESHGPU_DOCKER_CUDA_IMAGE="$CUDA_TAG"; else export MESHGPU_DOCKER_CUDA_IMAGE=-; fi
timed "container checks (e2e/docker)" go test -count=1 -timeout 15m ${DOCKER_TEST_VERBOSE:+-v} ./e2e/docker/

say "timings:"
for l in "${timings[@]}"; do say "  $l"; done
say "image sizes:"
for img in "$CPU_TAG" ${cuda:+"$CUDA_TAG"}; do
  say "  $img: $(docker image inspect -f '{{.Size}}' "$img" | awk '{printf "%.0f MB", $1 / 1e6}')"
done
