package node

import (
	"net/http"
	"os"
	"sync"
	"testing"
	"time"

	"meshgpu/engine"
	"meshgpu/internal/metricstest"
	"meshgpu/native"
)

// BenchmarkNodeStreams1B: one node holding a whole model
// ($MESHGPU_BENCH_MODEL, e.g. `meshgpu model synth --shape llama-3.2-1b`)
// on the CPU backend, greedy streams of 8 prompt and 32 generated tokens
// through its OpenAI API (/v1/completions, streamed, over loopback HTTP):
// aggregate generated tok/s of 1 stream and of 8 concurrent streams, each
// the best of b.N alternating runs, and their ratio, measured in the same
// run. MESHGPU_BENCH_MAXBATCH=-1 turns the scheduler off (the baseline
// before it was wired in).
func BenchmarkNodeStreams1B(b *testing.B) {
	dir := os.Getenv("MESHGPU_BENCH_MODEL")
	if dir == "" {
		b.Skip("set MESHGPU_BENCH_MODEL=DIR (e.g. from `meshgpu model synth --shape llama-3.2-1b`)")
	}
	maxBatch := 0
	if os.Getenv("MESHGPU_BENCH_MAXBATCH") == "-1" {
		maxBatch = -1
	}
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	const prompt, gen = 8, 32
	m, err := engine.Load(dir, engine.Options{Backend: be, First: 0, Last: -1, MaxContext: 64})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	s := &Server{Model: m, Backend: be, MaxBatch: maxBatch, Logger: quietLogger()}
	url, stop := serve(b, s.Handler())
	defer s.Close()
	defer stop()
	c := &http.Client{Timeout: 10 * time.Minute}
	defer c.CloseIdleConnections()
	streams := func(n int) float64 {
		start := time.Now()
		var wg sync.WaitGroup
		for k := 0; k < n; k++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ids := make([]int32, prompt)
				for i := range ids {
					ids[i] = int32(1 + k*prompt + i)
				}
				if got, err := streamIDs(c, url, ids, gen); err != nil || len(got) != gen {
					b.Errorf("stream %d: %d tokens, %v", k, len(got), err)
				}
			}()
		}
		wg.Wait()
		return float64(n*gen) / time.Since(start).Seconds()
	}
	var one, eight float64
	for i := 0; i < b.N; i++ {
		one = max(one, streams(1))
		eight = max(eight, streams(8))
	}
	b.ReportMetric(one, "tok/s_1stream")
	b.ReportMetric(eight, "tok/s_8streams")
	b.ReportMetric(eight/one, "ratio")
	fams := metricstest.Scrape(b, c, url+"/metrics")
	if f := fams["meshgpu_node_batch_sessions"]; f != nil && len(f.Metric) == 1 {
		h := f.Metric[0].Histogram
		b.ReportMetric(float64(h.GetSampleCount()), "calls")
		b.ReportMetric(h.GetSampleSum(), "session-steps")
	}
}
