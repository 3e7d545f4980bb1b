#!/usr/bin/env bash
# bench-vs-llamacpp.sh: CPU decode, prefill and concurrent streams of the
# same GGUF files, meshgpu against llama.cpp on the same machine, same
# threads, in one run, alternating ROUNDS times (dev-time;
# docs/performance.md, issue 24).
#
#   [MODES="decode prefill streams"] scripts/bench-vs-llamacpp.sh FILE.gguf [FILE.gguf ...]
#
# llama.cpp comes from npm's node-llama-cpp (prebuilt linux-x64 CPU
# binaries, installed into $NLC_DIR); meshgpu is `meshgpu bench decode`,
# `bench prefill` and `bench streams` on the same file. Modes:
#   decode:  TOKENS greedy tokens after a short prompt (llamacpp-decode.mjs)
#   prefill: one evaluation of a PREFILL-token prompt (llamacpp-prefill.mjs)
#   streams: STREAMS sequences generating TOKENS each at once, aggregate
#            tok/s with the prefill, and one stream alone: llama.cpp's
#            batched decode in one context of STREAMS sequences (what
#            llama-server -np STREAMS runs; llamacpp-streams.mjs) against
#            one meshgpu node's OpenAI API.
# Files: `meshgpu model synth --shape llama-3.2-1b --out F.gguf`, then
# `meshgpu model quantize --in F.gguf --out Q.gguf --type q4_k_m` (llama.cpp
# loads what it writes). MESHGPU may name several binaries (a base and a
# change, space-separated): each runs after llama.cpp in every round. Each
# line printed is one measurement: round R SIDE MODE FILE tok/s
# [one-stream tok/s].
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${ROUNDS:-3}
tokens=${TOKENS:-32}
prefill=${PREFILL:-512}
streams=${STREAMS:-8}
modes=${MODES:-decode prefill streams}
nlc=${NLC_DIR:-/tmp/nlc}
threads=${THREADS:-$(nproc)}
bins=${MESHGPU:-$root/bin/meshgpu}
[ $# -gt 0 ] || { echo "usage: $0 FILE.gguf [FILE.gguf ...]" >&2; exit 2; }
if [ ! -d "$nlc/node_modules/node-llama-cpp" ]; then
  mkdir -p "$nlc" && (cd "$nlc" && npm init -y >/dev/null && npm install node-llama-cpp@3.22.1 --ignore-scripts)
fi
cp "$root/scripts/llamacpp-decode.mjs" "$nlc/tg.mjs"
cp "$root/scripts/llamacpp-prefill.mjs" "$nlc/pp.mjs"
cp "$root/scripts/llamacpp-streams.mjs" "$nlc/st.mjs"
for bin in $bins; do [ -x "$bin" ] || (cd "$root" && make build); done
echo "date $(date -u +%FT%TZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $threads threads, decode $tokens tokens, prefill $prefill, $streams streams; load $(cut -d' ' -f1-3 /proc/loadavg)"
mg() { "$bin" bench "$@" --threads "$threads" --wide 2>/dev/null; }
side() { [ "$(echo $bins | wc -w)" -gt 1 ] && echo "meshgpu:$bin" || echo meshgpu; }
for r in $(seq "$rounds"); do
  for f in "$@"; do
    b=$(basename "$f")
    for m in $modes; do
      case $m in
      decode) ll=$(cd "$nlc" && THREADS=$threads node tg.mjs "$f" "$tokens" 2 | sed -n 's/^LLAMACPP_TG[0-9]* best \([0-9.]*\) tok\/s.*/\1/p') ;;
      prefill) ll=$(cd "$nlc" && THREADS=$threads node pp.mjs "$f" "$prefill" 2 | sed -n 's/^LLAMACPP_PP[0-9]* best \([0-9.]*\) tok\/s.*/\1/p') ;;
      streams) ll=$(cd "$nlc" && THREADS=$threads node st.mjs "$f" "$tokens" "$streams" 1 | sed -n 's/^LLAMACPP_STREAMS[0-9]* one \([0-9.]*\) many \([0-9.]*\) .*/\2 \1/p') ;;
      *) echo "unknown mode $m (want decode, prefill, streams)" >&2; exit 2 ;;
      esac
      echo "round $r llama.cpp $m $b $ll  (load $(cut -d' ' -f1 /proc/loadavg))"
      for bin in $bins; do
        case $m in
        decode) me=$(mg decode --model "$f" -n "$tokens" | awk '$1 == "meshgpu-cpu" {print $NF}') ;;
        prefill) me=$(mg prefill --model "$f" --prompt-tokens "$prefill" -n 2 | awk '$1 == "meshgpu-cpu" {print $(NF-1)}') ;;
        streams) me=$(mg streams --model "$f" --streams "$streams" -n "$tokens" --prompt-tokens 8 | awk '$1 == "one-stream" {o = $NF} $1 == "concurrent-streams" {c = $NF} END {print c, o}') ;;
        esac
        echo "round $r $(side) $m $b $me  (load $(cut -d' ' -f1 /proc/loadavg))"
      done
    done
  done
done
