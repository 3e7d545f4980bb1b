# meshgpu build entry points. `make` builds the binary (and compile-checks
# the CUDA kernels when nvcc is present); `make test` is what CI runs.
GO ?= go
BIN ?= bin/meshgpu
# --version prints git describe (tag, commits since, hash, -dirty); the
# Docker builds pass it in as a build arg, having no .git.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)
LDFLAGS ?= -X meshgpu/internal/buildinfo.Version=$(VERSION)

.PHONY: all build test vet demo kernels-check cuda device-bundle docker-test clean

all: build kernels-check

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/meshgpu

# demo: a relay, a tracker and three nodes on 127.0.0.1 streaming one answer
# (docs/demo.md); Ctrl-C stops it. Pass flags with DEMO_ARGS="--once".
DEMO_ARGS ?=
demo: build
	$(BIN) demo $(DEMO_ARGS)

test:
	$(GO) vet ./...
	$(GO) test -timeout 25m ./...

vet:
	$(GO) vet ./...

# fuzz-frames: a short run of each frame fuzzer (the codec is hopmux's),
# for development (the seed corpus also runs in `make test`; CI runs no
# open-ended fuzzing).
FUZZTIME ?= 10s
fuzz-frames:
	for f in FuzzHopFrame FuzzBinding FuzzHopReply FuzzParse; do $(GO) test -run XXX -fuzz "^$$f$$" -fuzztime $(FUZZTIME) ./hopmux || exit 1; done
	$(GO) test -run XXX -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME) ./ticket

# --- cuda ---
# (targets: cuda, kernels-check, device-bundle; maintained by the kernels work)
# cuda: libmeshgpu_cuda.so via CMake (CMAKE_CUDA_ARCHITECTURES defaults to 80;89;90).
CUDA_BUILD_DIR ?= build/cuda
cuda:
	cmake -S . -B $(CUDA_BUILD_DIR) -DCMAKE_BUILD_TYPE=Release
	cmake --build $(CUDA_BUILD_DIR) --parallel $$(nproc)

# kernels-check: compile every kernel and link the library (needs nvcc; CI
# installs it with scripts/install-cuda-toolkit.sh).
kernels-check:
	@if command -v nvcc >/dev/null 2>&1; then bash scripts/cuda-compile-check.sh; else echo "nvcc not found: skipping the CUDA compile check"; fi

# device-bundle: stripped test binaries and the test model in .device/ for
# the GPU host (docs/device-check.md: carry [".device"], run scripts/device-check.sh).
device-bundle:
	bash scripts/device-bundle.sh
# --- cuda ---

# docker-test: build the images (Dockerfile: meshgpu:cpu, Dockerfile.cuda:
# meshgpu) from local Debian-made bases and run a node in each (docs/docker.md).
docker-test:
	bash scripts/docker-test.sh

clean:
	rm -rf bin build .device
