package node_test

import (
	"context"
	"os"
	"testing"

	"meshgpu/bench"
)

// BenchmarkNodeStreams1B: one node holding a whole model
// ($MESHGPU_BENCH_MODEL, e.g. `meshgpu model synth --shape llama-3.2-1b`)
// on the CPU backend, greedy streams of 8 prompt and 32 generated tokens
// through its OpenAI API (/v1/completions, streamed, over loopback HTTP):
// aggregate generated tok/s of 1 stream and of 8 concurrent streams, each
// the best of b.N alternating runs, and their ratio, measured in the same
// run. MESHGPU_BENCH_MAXBATCH=-1 turns the scheduler off (the baseline
// before it was wired in). It runs the `meshgpu bench streams` suite
// (bench.Streams), which the device check runs on the H200.
func BenchmarkNodeStreams1B(b *testing.B) {
	dir := os.Getenv("MESHGPU_BENCH_MODEL")
	if dir == "" {
		b.Skip("set MESHGPU_BENCH_MODEL=DIR (e.g. from `meshgpu model synth --shape llama-3.2-1b`)")
	}
	maxBatch := 0
	if os.Getenv("MESHGPU_BENCH_MAXBATCH") == "-1" {
		maxBatch = -1
	}
	rep, err := bench.Streams(context.Background(), bench.StreamsConfig{Backend: bench.BackendConfig{Name: "cpu"},
		Model: bench.ModelSource{Dir: dir}, Streams: 8, N: 32, PromptTokens: 8, MaxBatch: maxBatch, Rounds: b.N})
	if err != nil {
		b.Fatal(err)
	}
	one, _ := rep.Find(bench.SeriesOneStream, 1)
	eight, _ := rep.Find(bench.SeriesConcurrent, 8)
	b.ReportMetric(one.Extra["tok_s"], "tok/s_1stream")
	b.ReportMetric(eight.Extra["tok_s"], "tok/s_8streams")
	b.ReportMetric(eight.Extra["ratio"], "ratio")
	b.ReportMetric(one.Extra["calls"]+eight.Extra["calls"], "calls")
	b.ReportMetric(one.Extra["session_steps"]+eight.Extra["session_steps"], "session-steps")
}
