#!/usr/bin/env bash
# cuda-compile-check.sh: check CMakeLists.txt lists every kernels/*.cu,
# compile them for the CUDA archs this nvcc supports (of 80, 89, 90), link
# libmeshgpu_cuda.so with -Wl,--no-undefined, check it exports exactly the
# two entry points, and run kernels/tests/dispatch_test.cu (host only).
# With cmake: the real CMakeLists.txt build (warnings are errors). Without:
# nvcc per file and a manual link. Any failure exits non-zero, loudly.
#
#   bash scripts/cuda-compile-check.sh [build-dir]     (default build/cuda-check)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/cuda-check}
mkdir -p "$(dirname "$out")"

command -v nvcc >/dev/null || { echo "cuda-compile-check: nvcc not found (apt-get install nvidia-cuda-toolkit)" >&2; exit 1; }
nvcc_version=$(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
have=$(nvcc --list-gpu-arch 2>/dev/null | sed -n 's/^compute_//p' | tr '\n' ' ')
archs=()
for a in 80 89 90; do
  case " $have " in *" $a "*) archs+=("$a");; esac
done
[ ${#archs[@]} -gt 0 ] || { echo "cuda-compile-check: nvcc $nvcc_version supports none of sm_80/89/90" >&2; exit 1; }
echo "cuda-compile-check: nvcc $nvcc_version, archs ${archs[*]}"

# The CMake build must list every kernels/*.cu (a file left out links
# only when nothing calls it, and fails at dlopen when something does).
for f in kernels/*.cu; do
  grep -qx "  $f" CMakeLists.txt || { echo "cuda-compile-check: $f is not in CMakeLists.txt's add_library" >&2; exit 1; }
done

lib=""
if command -v cmake >/dev/null; then
  arch_list=$(IFS=';'; echo "${archs[*]}")
  cmake -S . -B "$out" -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CUDA_ARCHITECTURES=$arch_list" \
    "-DCMAKE_CUDA_FLAGS=-Werror all-warnings" >"$out.cmake.log" 2>&1 \
    || { cat "$out.cmake.log" >&2; echo "cuda-compile-check: cmake configure FAILED" >&2; exit 1; }
  cmake --build "$out" -j "$(nproc)" \
    || { echo "cuda-compile-check: build FAILED" >&2; exit 1; }
  lib="$out/libmeshgpu_cuda.so"
else
  mkdir -p "$out"
  gencode=()
  for a in "${archs[@]}"; do gencode+=("-gencode=arch=compute_$a,code=sm_$a"); done
  objs=()
  for f in kernels/*.cu; do
    o="$out/$(basename "$f" .cu).o"
    echo "nvcc -c $f"
    nvcc -std=c++17 -O3 -Xcompiler=-fPIC,-fvisibility=hidden -Werror all-warnings "${gencode[@]}" \
      -Ikernels -Inative -c "$f" -o "$o" || { echo "cuda-compile-check: $f FAILED to compile" >&2; exit 1; }
    objs+=("$o")
  done
  lib="$out/libmeshgpu_cuda.so"
  nvcc -shared -Xlinker=--no-undefined "${objs[@]}" -o "$lib" -lcublas -lcublasLt -cudart static \
    || { echo "cuda-compile-check: link FAILED" >&2; exit 1; }
fi

# The kernel-choice rule against its table (host code, no GPU needed).
nvcc -std=c++17 -Werror all-warnings -Ikernels -Inative kernels/tests/dispatch_test.cu -o "$out/dispatch_test" \
  || { echo "cuda-compile-check: kernels/tests/dispatch_test.cu FAILED to compile" >&2; exit 1; }
"$out/dispatch_test" || { echo "cuda-compile-check: the kernel-choice rule does not match its table" >&2; exit 1; }

exports=$(nm -D --defined-only "$lib" | awk '$2 == "T" {print $3}' | sort | tr '\n' ' ')
if [ "$exports" != "mg_cuda_api mg_cuda_ops " ]; then
  echo "cuda-compile-check: $lib exports [$exports], want [mg_cuda_api mg_cuda_ops]" >&2
  exit 1
fi
if ldd "$lib" | grep -q "not found"; then
  ldd "$lib" >&2
  echo "cuda-compile-check: $lib has unresolved libraries" >&2
  exit 1
fi
echo "cuda-compile-check: OK ($lib exports: $exports)"
