// llamacpp-decode.mjs: llama.cpp (node-llama-cpp) greedy decode speed on a GGUF: N tokens after a short prompt, best of REPS (dev-time; scripts/bench-vs-llamacpp.sh).
import {getLlama} from "node-llama-cpp";
const [modelPath, nTok = "64", reps = "3"] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "warn"});
const model = await llama.loadModel({modelPath});
const n = Number(nTok);
const ctx = await model.createContext({contextSize: n + 64, batchSize: 64, threads: Number(process.env.THREADS || 2)});
const seq = ctx.getSequence();
const prompt = Array.from({length: 16}, (_, i) => (i * 7919 + 13) % 278);
let best = Infinity;
for (let r = 0; r < Number(reps); r++) {
  await seq.clearHistory();
  await seq.evaluateWithoutGeneratingNewTokens(prompt);
  let got = 0, t0 = 0;
  // Time from the first generated token: decode only, as meshgpu's decode suite does.
  for await (const _ of seq.evaluate([prompt[0]], {temperature: 0})) {
    if (got === 0) t0 = performance.now();
    if (++got > n) break;
  }
  const dt = (performance.now() - t0) / 1000;
  best = Math.min(best, dt);
  console.log(`llama.cpp rep ${r}: ${n} tokens in ${dt.toFixed(3)} s = ${(n / dt).toFixed(1)} tok/s`);
}
console.log(`LLAMACPP_TG${n} best ${(n / best).toFixed(1)} tok/s (threads ${process.env.THREADS || 2}, llama.cpp ${llama.llamaCppRelease?.release ?? ""})`);
process.exit(0);
