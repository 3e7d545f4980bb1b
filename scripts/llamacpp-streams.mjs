// llamacpp-streams.mjs: llama.cpp (node-llama-cpp) aggregate greedy tok/s of S sequences generating at once in one context (its batched decode, as llama-server -np S does), against one sequence alone, best of REPS each, alternating (dev-time; scripts/bench-vs-llamacpp.sh).
import {getLlama} from "node-llama-cpp";
const [modelPath, nTok = "32", streams = "8", reps = "2"] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "warn"});
const model = await llama.loadModel({modelPath});
const n = Number(nTok), s = Number(streams), promptLen = 8;
const threads = Number(process.env.THREADS || 2);
// One context of S sequences (as llama-server -np S); one stream uses its first.
const ctx = await model.createContext({sequences: s, contextSize: s * (promptLen + n + 8), batchSize: 512, threads});
const seqs = Array.from({length: s}, () => ctx.getSequence());
const seq1 = seqs[0];
// Stream k's prompt counts up from its own start (no shared prefix), as meshgpu bench streams' does.
const prompt = (k) => Array.from({length: promptLen}, (_, i) => 1 + (k * promptLen + i) % 277);
async function gen(seq, k) {
  await seq.clearHistory();
  let got = 0;
  for await (const _ of seq.evaluate(prompt(k), {temperature: 0})) if (++got >= n) break;
  return got;
}
// Wall time from the first prompt to the last token, prefill included (meshgpu bench streams measures the same).
async function timed(list) {
  const t0 = performance.now();
  const got = await Promise.all(list.map((q, k) => gen(q, k)));
  return got.reduce((a, b) => a + b, 0) / ((performance.now() - t0) / 1000);
}
await gen(seq1, 0); // warm-up: pages the weights in
let best1 = 0, bestS = 0;
for (let r = 0; r < Number(reps); r++) {
  const a = await timed([seq1]);
  const b = await timed(seqs);
  best1 = Math.max(best1, a);
  bestS = Math.max(bestS, b);
  console.log(`llama.cpp rep ${r}: 1 stream ${a.toFixed(1)} tok/s, ${s} streams ${b.toFixed(1)} tok/s aggregate`);
}
console.log(`LLAMACPP_STREAMS${s} one ${best1.toFixed(1)} many ${bestS.toFixed(1)} tok/s ratio ${(bestS / best1).toFixed(2)} (threads ${threads}, ${n} tokens each, llama.cpp ${llama.llamaCppRelease?.release ?? ""})`);
process.exit(0);
