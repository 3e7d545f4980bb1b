#!/usr/bin/env bash
# bench-prefill-vs-llamacpp.sh: CPU prefill of 512 tokens, meshgpu against
# llama.cpp on the same machine and the same weights, in one run (dev-time;
# docs/performance.md). Alternates the two ROUNDS times; take each side's best.
#
#   scripts/bench-prefill-vs-llamacpp.sh [MODEL_DIR]
#
# MODEL_DIR defaults to a synthesized Llama-3.2-1B shape in /tmp/synth1b.
# llama.cpp comes from npm's node-llama-cpp (prebuilt linux-x64 CPU
# binaries, installed into $NLC_DIR); the weights are converted to GGUF by
# scripts/safetensors-to-gguf.py (bf16 kept as bf16). SUBS picks the meshgpu
# paths (default: avx512f/f32 avx512f/bf16 avx512bf16/bf16 avx2/f32).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
model=${1:-/tmp/synth1b}
rounds=${ROUNDS:-2}
nlc=${NLC_DIR:-/tmp/nlc}
threads=${THREADS:-$(nproc)}
go=${GO:-go}
if [ ! -f "$model/model.safetensors" ]; then
  (cd "$root" && $go run ./cmd/meshgpu model synth --shape llama-3.2-1b --out "$model")
fi
[ -f "$model.gguf" ] || python3 "$root/scripts/safetensors-to-gguf.py" "$model" "$model.gguf"
if [ ! -d "$nlc/node_modules/node-llama-cpp" ]; then
  mkdir -p "$nlc" && (cd "$nlc" && npm init -y >/dev/null && npm install node-llama-cpp@3.22.1 --ignore-scripts)
fi
cp "$root/scripts/llamacpp-prefill.mjs" "$nlc/pp.mjs"
(cd "$root" && $go test -c -o /tmp/meshgpu-engine.test ./engine)
echo "date $(date -u +%FT%TZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $threads threads"
for _ in $(seq "$rounds"); do
  (cd "$nlc" && THREADS=$threads node pp.mjs "$model.gguf" 512 3 | tail -1)
  for sub in ${SUBS:-avx512f/f32 avx512f/bf16 avx512bf16/bf16 avx2/f32}; do
    MESHGPU_BENCH_MODEL=$model /tmp/meshgpu-engine.test -test.run '^$' -test.bench "CPUPrefill1B/$sub\$" -test.benchtime 2x | grep Benchmark || true
  done
done
