# meshgpu build entry points. `make` builds the binary (and compile-checks
# the CUDA kernels when nvcc is present); `make test` is what CI runs.
GO ?= go
BIN ?= bin/meshgpu

.PHONY: all build test vet demo kernels-check cuda device-bundle clean

all: build kernels-check

build:
	$(GO) build -o $(BIN) ./cmd/meshgpu

test:
	$(GO) test ./...

vet:
	$(GO) vet ./...

# --- cuda ---
# (targets: cuda, kernels-check, device-bundle; maintained by the kernels work)
kernels-check:
	@if command -v nvcc >/dev/null 2>&1; then bash scripts/cuda-compile-check.sh; else echo "nvcc not found: skipping the CUDA compile check"; fi
# --- cuda ---

clean:
	rm -rf bin build .device
