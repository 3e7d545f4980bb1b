#!/usr/bin/env bash
# bench-vs-llamacpp.sh: CPU decode (and prefill) of the same GGUF files,
# meshgpu against llama.cpp on the same machine, same threads, in one run,
# alternating ROUNDS times (dev-time; docs/performance.md, issue 24).
#
#   scripts/bench-vs-llamacpp.sh FILE.gguf [FILE.gguf ...]
#
# llama.cpp comes from npm's node-llama-cpp (prebuilt linux-x64 CPU
# binaries, installed into $NLC_DIR); meshgpu is `meshgpu bench decode` on
# the same file. Files: `meshgpu model synth --shape llama-3.2-1b --out
# F.gguf`, then `meshgpu model quantize --in F.gguf --out Q.gguf --type
# q4_k_m` (llama.cpp loads what it writes). Each line printed is one
# measurement: SIDE FILE tok/s.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${ROUNDS:-3}
tokens=${TOKENS:-32}
nlc=${NLC_DIR:-/tmp/nlc}
threads=${THREADS:-$(nproc)}
bin=${MESHGPU:-$root/bin/meshgpu}
[ $# -gt 0 ] || { echo "usage: $0 FILE.gguf [FILE.gguf ...]" >&2; exit 2; }
if [ ! -d "$nlc/node_modules/node-llama-cpp" ]; then
  mkdir -p "$nlc" && (cd "$nlc" && npm init -y >/dev/null && npm install node-llama-cpp@3.22.1 --ignore-scripts)
fi
cp "$root/scripts/llamacpp-decode.mjs" "$nlc/tg.mjs"
[ -x "$bin" ] || (cd "$root" && make build)
echo "date $(date -u +%FT%TZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $threads threads, $tokens tokens"
for r in $(seq "$rounds"); do
  for f in "$@"; do
    ll=$(cd "$nlc" && THREADS=$threads node tg.mjs "$f" "$tokens" 2 | sed -n 's/^LLAMACPP_TG[0-9]* best \([0-9.]*\) tok\/s.*/\1/p')
    echo "round $r llama.cpp $(basename "$f") $ll"
    mg=$("$bin" bench decode --model "$f" -n "$tokens" --threads "$threads" --wide 2>/dev/null | awk '$1 == "meshgpu-cpu" {print $NF}')
    echo "round $r meshgpu $(basename "$f") $mg"
  done
done
