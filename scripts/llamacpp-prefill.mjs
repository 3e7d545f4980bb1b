// llamacpp-prefill.mjs: llama.cpp (node-llama-cpp) prefill time of N tokens on a GGUF, best of REPS (dev-time; scripts/bench-vs-llamacpp.sh, scripts/bench-prefill-vs-llamacpp.sh).
import {getLlama} from "node-llama-cpp";
const [modelPath, nTok = "512", reps = "3"] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "warn"});
const model = await llama.loadModel({modelPath});
const n = Number(nTok);
const ctx = await model.createContext({contextSize: n + 16, batchSize: n, threads: Number(process.env.THREADS || 2)});
const seq = ctx.getSequence();
const tokens = Array.from({length: n}, (_, i) => (i * 7919 + 13) % 278);
let best = Infinity;
for (let r = 0; r < Number(reps); r++) {
  await seq.clearHistory();
  const t0 = performance.now();
  await seq.evaluateWithoutGeneratingNewTokens(tokens);
  const dt = (performance.now() - t0) / 1000;
  best = Math.min(best, dt);
  console.log(`llama.cpp ${llama.cpuMathCores ?? ""} rep ${r}: ${n} tokens in ${dt.toFixed(3)} s = ${(n / dt).toFixed(1)} tok/s`);
}
console.log(`LLAMACPP_PP${n} best ${(n / best).toFixed(1)} tok/s (threads ${process.env.THREADS || 2}, node-llama-cpp ${llama.buildType ?? ""} llama.cpp ${llama.llamaCppRelease?.release ?? ""})`);
process.exit(0);
