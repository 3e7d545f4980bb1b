package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"meshgpu/model"
	"meshgpu/native"
	"meshgpu/sample"
)

// benchModelDir is $MESHGPU_BENCH_MODEL, or a Llama-3.2-1B-shaped random
// model synthesized into a temp dir when MESHGPU_BENCH_1B=1 (2.5 GB written),
// or "" (skip).
func benchModelDir(b *testing.B) string {
	if d := os.Getenv("MESHGPU_BENCH_MODEL"); d != "" {
		return d
	}
	if os.Getenv("MESHGPU_BENCH_1B") != "1" {
		b.Skip("set MESHGPU_BENCH_1B=1 (synthesizes 2.5 GB) or MESHGPU_BENCH_MODEL=DIR (e.g. from `meshgpu model synth --shape llama-3.2-1b`)")
	}
	dir := b.TempDir()
	start := time.Now()
	if _, err := model.Synth(context.Background(), dir, model.SynthOptions{Shape: "llama-3.2-1b", Seed: 1}); err != nil {
		b.Fatal(err)
	}
	b.Logf("synthesized llama-3.2-1b in %v", time.Since(start).Round(time.Millisecond))
	return dir
}

// BenchmarkCPUDecode1B decodes one token per iteration on the CPU backend and
// reports tok/s, the weight bytes streamed per second, and that as a share
// of the machine's memory read bandwidth measured in the same run, before
// and after (target >= 50%).
func BenchmarkCPUDecode1B(b *testing.B) {
	dir := benchModelDir(b)
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	m, err := Load(dir, Options{Backend: be, First: 0, Last: -1, MaxContext: 512})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	cfg := m.Config
	// Every decoded token reads every layer's weights, the final norm and
	// the LM head (the embedding table when tied); one embedding row is noise.
	weightBytes := float64(int64(cfg.NumLayers)*cfg.LayerBytes(model.BF16) + cfg.EmbedBytes(model.BF16) + int64(cfg.Hidden)*2)

	bw, err := native.MemReadBandwidth(1<<30, 0, 5)
	if err != nil {
		b.Fatal(err)
	}

	prompt := []int32{1, 2, 3, 4, 5, 6, 7, 8}
	const ctxLen = 512
	sess, err := m.Stack.NewSession(ctxLen)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { sess.Close() }()
	ctx := context.Background()
	step := m.LocalStepper(sess, sample.Params{}, native.F32)
	id, _, err := step(ctx, 0, prompt, 0)
	if err != nil {
		b.Fatal(err)
	}
	pos := len(prompt)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if pos == ctxLen {
			pos = len(prompt) // truncate back: same work per token, bounded cache
		}
		if id, _, err = step(ctx, pos, []int32{id}, i+1); err != nil {
			b.Fatal(err)
		}
		pos++
	}
	sec := b.Elapsed().Seconds() / float64(b.N)
	b.StopTimer()
	// The bandwidth of a shared machine drifts: take the better of before
	// and after, so the ratio errs low.
	bwAfter, err := native.MemReadBandwidth(1<<30, 0, 5)
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("memory read bandwidth: %.1f GB/s before, %.1f GB/s after", bw, bwAfter)
	bw = max(bw, bwAfter)
	gbps := weightBytes / sec / 1e9
	b.ReportMetric(1/sec, "tok/s")
	b.ReportMetric(gbps, "weight_GB/s")
	b.ReportMetric(bw, "mem_read_GB/s")
	b.ReportMetric(100*gbps/bw, "%_of_mem_bw")
	b.Logf("%s: %.2f GB of weights per token, %.2f tok/s, %.1f GB/s of %.1f GB/s memory read bandwidth (%.0f%%), backend %s",
		dir, weightBytes/1e9, 1/sec, gbps, bw, 100*gbps/bw, be.Describe())
}

// BenchmarkCPUPrefill1B prefills 512 tokens in one forward call (all layers,
// then the last row's logits, as a generation does) on each matrix-product
// path and activation dtype, and reports tok/s. Compare with llama.cpp's
// pp512 on the same weights (docs/performance.md, bench/gguf).
func BenchmarkCPUPrefill1B(b *testing.B) {
	dir := benchModelDir(b)
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	const n = 512
	m, err := Load(dir, Options{Backend: be, First: 0, Last: -1, MaxContext: n})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	b.Cleanup(func() { native.SetCPUISA("") })
	tokens := make([]int32, n)
	for i := range tokens {
		tokens[i] = int32((i*7919 + 13) % m.Config.Vocab)
	}
	for _, isa := range native.CPUISAs() {
		for _, dt := range []native.DType{native.F32, native.BF16} {
			b.Run(isa+"/"+dt.String(), func(b *testing.B) {
				if err := native.SetCPUISA(isa); err != nil {
					b.Fatal(err)
				}
				sess, err := m.Stack.NewSession(n)
				if err != nil {
					b.Fatal(err)
				}
				defer sess.Close()
				row := m.Config.Hidden * dt.Size()
				act := make([]byte, n*row)
				logits := make([]float32, m.Config.Vocab)
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if err := m.Stack.Embed(tokens, dt, act); err != nil {
						b.Fatal(err)
					}
					if err := m.Stack.Forward([]native.Step{{Session: sess, Pos: 0, NTokens: n}}, m.First, m.Last, dt, act, act); err != nil {
						b.Fatal(err)
					}
					if err := m.Stack.Logits(1, dt, act[(n-1)*row:], logits); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "tok/s")
			})
		}
	}
}

// BenchmarkCPUDecodeBatch1B times one decode step (all layers) for 1 and
// for 8 sessions in one forward call, on every path, f32 and bf16
// activations: the weights are read once per step either way, so batch 8
// should cost far less than 8 batch-1 steps.
func BenchmarkCPUDecodeBatch1B(b *testing.B) {
	dir := benchModelDir(b)
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	const ctxLen = 64
	m, err := Load(dir, Options{Backend: be, First: 0, Last: -1, MaxContext: ctxLen})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	b.Cleanup(func() { native.SetCPUISA("") })
	for _, isa := range native.CPUISAs() {
		for _, dt := range []native.DType{native.F32, native.BF16} {
			for _, batch := range []int{1, 8} {
				b.Run(fmt.Sprintf("%s/%s/batch%d", isa, dt, batch), func(b *testing.B) {
					if err := native.SetCPUISA(isa); err != nil {
						b.Fatal(err)
					}
					decodeSteps(b, m, dt, batch, ctxLen)
				})
			}
		}
	}
}

func decodeSteps(b *testing.B, m *Model, dt native.DType, batch, ctxLen int) {
	steps := make([]native.Step, batch)
	for i := range steps {
		s, err := m.Stack.NewSession(ctxLen)
		if err != nil {
			b.Fatal(err)
		}
		defer s.Close()
		steps[i] = native.Step{Session: s, Pos: 0, NTokens: 1}
	}
	act := make([]byte, batch*m.Config.Hidden*dt.Size())
	toks := make([]int32, batch)
	for i := range toks {
		toks[i] = int32(1 + i)
	}
	if err := m.Stack.Embed(toks, dt, act); err != nil {
		b.Fatal(err)
	}
	cpu0 := processCPU(b)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := range steps {
			steps[j].Pos = i % (ctxLen - 1)
		}
		if err := m.Stack.Forward(steps, m.First, m.Last, dt, act, act); err != nil {
			b.Fatal(err)
		}
	}
	sec := b.Elapsed().Seconds() / float64(b.N)
	b.ReportMetric(sec*1e3, "ms/step")
	b.ReportMetric(float64(batch)/sec, "tok/s")
	// CPU time (all threads) per token: comparable between runs on a shared
	// machine, where wall time depends on the other processes.
	b.ReportMetric((processCPU(b)-cpu0).Seconds()*1e3/float64(b.N*batch), "cpu_ms/token")
}

// processCPU is the CPU time (user + system) this process has used so far.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// quantBenchFiles is $MESHGPU_BENCH_GGUF_DIR's bf16.gguf, q8_0.gguf and
// q4_k_m.gguf (what `meshgpu model synth --shape llama-3.2-1b --out
// DIR/bf16.gguf` and `meshgpu model quantize --in DIR/bf16.gguf --out
// DIR/q8_0.gguf --type q8_0` (and q4_k_m) write), or skips.
func quantBenchFiles(b *testing.B) map[string]string {
	dir := os.Getenv("MESHGPU_BENCH_GGUF_DIR")
	if dir == "" {
		b.Skip("set MESHGPU_BENCH_GGUF_DIR=DIR holding bf16.gguf, q8_0.gguf, q4_k_m.gguf of the llama-3.2-1b shape (docs/performance.md, issue 24)")
	}
	files := map[string]string{}
	for _, name := range []string{"bf16", "q8_0", "q4_k_m"} {
		p := filepath.Join(dir, name+".gguf")
		if _, err := os.Stat(p); err != nil {
			b.Fatal(err)
		}
		files[name] = p
	}
	return files
}

// streamedBytes is what one decode step reads of a model's weights as
// stored: every layer, the final norm and the LM head (the embedding table
// when tied).
func streamedBytes(b *testing.B, path string) int64 {
	ck, err := model.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer ck.Close()
	cfg, err := model.LoadConfig(path)
	if err != nil {
		b.Fatal(err)
	}
	var n int64
	for _, s := range cfg.Tensors(0, cfg.NumLayers-1, false, true) {
		t, err := ck.Info(s.Name)
		if err != nil {
			b.Fatal(err)
		}
		n += t.Bytes
	}
	return n
}

// BenchmarkCPUQuantized1B: decode (one token per iteration, f32
// activations, as BenchmarkCPUDecode1B) and prefill (128 tokens in one
// forward call, then the last row's logits), and decode steps of 1 and 8
// sessions in one forward call (decodeSteps: all layers, no LM head, with
// the CPU time per token beside the wall time) of the same synthetic
// Llama-3.2-1B as bf16, Q8_0 and Q4_K_M GGUF files, on the default path, in
// one run: tok/s, weight bytes streamed per second, and that as a share of
// the memory read bandwidth measured in the same run.
func BenchmarkCPUQuantized1B(b *testing.B) {
	files := quantBenchFiles(b)
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	for _, name := range []string{"bf16", "q8_0", "q4_k_m"} {
		path := files[name]
		bytes := float64(streamedBytes(b, path))
		m, err := Load(path, Options{Backend: be, First: 0, Last: -1, MaxContext: 512})
		if err != nil {
			b.Fatal(err)
		}
		b.Run(name+"/decode", func(b *testing.B) {
			bw, err := native.MemReadBandwidth(1<<30, 0, 3)
			if err != nil {
				b.Fatal(err)
			}
			sess, err := m.Stack.NewSession(512)
			if err != nil {
				b.Fatal(err)
			}
			defer sess.Close()
			ctx := context.Background()
			step := m.LocalStepper(sess, sample.Params{}, native.F32)
			prompt := []int32{1, 2, 3, 4, 5, 6, 7, 8}
			id, _, err := step(ctx, 0, prompt, 0)
			if err != nil {
				b.Fatal(err)
			}
			pos := len(prompt)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if pos == 512 {
					pos = len(prompt)
				}
				if id, _, err = step(ctx, pos, []int32{id}, i+1); err != nil {
					b.Fatal(err)
				}
				pos++
			}
			sec := b.Elapsed().Seconds() / float64(b.N)
			b.StopTimer()
			bwAfter, err := native.MemReadBandwidth(1<<30, 0, 3)
			if err != nil {
				b.Fatal(err)
			}
			bw = max(bw, bwAfter)
			gbps := bytes / sec / 1e9
			b.ReportMetric(1/sec, "tok/s")
			b.ReportMetric(bytes/1e9, "GB/token")
			b.ReportMetric(gbps, "weight_GB/s")
			b.ReportMetric(bw, "mem_read_GB/s")
			b.ReportMetric(100*gbps/bw, "%_of_mem_bw")
		})
		for _, batch := range []int{1, 8} { // all layers, no LM head: per token, batch 8 against 1
			b.Run(fmt.Sprintf("%s/decode-batch%d", name, batch), func(b *testing.B) { decodeSteps(b, m, native.F32, batch, 512) })
		}
		b.Run(name+"/prefill128", func(b *testing.B) {
			const n = 128
			tokens := make([]int32, n)
			for i := range tokens {
				tokens[i] = int32((i*7919 + 13) % m.Config.Vocab)
			}
			sess, err := m.Stack.NewSession(n)
			if err != nil {
				b.Fatal(err)
			}
			defer sess.Close()
			row := m.Config.Hidden * 4
			act := make([]byte, n*row)
			logits := make([]float32, m.Config.Vocab)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := m.Stack.Embed(tokens, native.F32, act); err != nil {
					b.Fatal(err)
				}
				if err := m.Stack.Forward([]native.Step{{Session: sess, Pos: 0, NTokens: n}}, m.First, m.Last, native.F32, act, act); err != nil {
					b.Fatal(err)
				}
				if err := m.Stack.Logits(1, native.F32, act[(n-1)*row:], logits); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "tok/s")
		})
		m.Close()
	}
}
