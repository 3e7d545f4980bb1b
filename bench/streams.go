package bench

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"meshgpu/engine"
	"meshgpu/node"
)

// StreamsConfig sizes the streams suite.
type StreamsConfig struct {
	Backend BackendConfig
	// Model is the model the node serves, all its layers (default:
	// synthesized tiny).
	Model ModelSource
	// Streams is how many concurrent streams are timed against one
	// (default 8, at most 64).
	Streams int
	N       int // generated tokens per stream (default 32)
	// PromptTokens is each stream's prompt length (default 8).
	PromptTokens int
	// MaxBatch is node.Server.MaxBatch: 0 the node's default, negative no
	// scheduler (each step alone).
	MaxBatch int
	// Rounds alternates one stream and Streams streams this many times;
	// each side's best round counts (default 1).
	Rounds int
	Logger *slog.Logger
}

// Series of the streams suite.
const (
	SeriesOneStream  = "one-stream"
	SeriesConcurrent = "concurrent-streams"
)

// maxStreams bounds --streams: the node's default session limit.
const maxStreams = node.DefaultMaxSessions

// Streams serves a whole model from one in-process node on 127.0.0.1 and
// streams greedy completions from its OpenAI API (/v1/completions, SSE):
// one stream alone, then Streams at once, in the same run. Each row's
// tok_s is the generated tokens of all its streams over the wall time from
// the first request to the last [DONE] (prefill included); the concurrent
// row's ratio is its tok_s over one stream's, the gain of the node's
// scheduler (node/batch.go, package sched) batching sessions into one
// forward call. p50/p99 are the gaps between one stream's tokens.
// calls, session_steps and mean_batch come from the node's
// meshgpu_node_batch_sessions histogram over that side's timed runs.
func Streams(ctx context.Context, cfg StreamsConfig) (*Report, error) {
	if cfg.Model.Dir == "" && cfg.Model.Synth == "" {
		cfg.Model.Synth = "tiny"
	}
	if cfg.Streams <= 0 {
		cfg.Streams = 8
	}
	if cfg.N <= 0 {
		cfg.N = 32
	}
	if cfg.PromptTokens <= 0 {
		cfg.PromptTokens = 8
	}
	if cfg.Rounds <= 0 {
		cfg.Rounds = 1
	}
	if cfg.Streams < 2 || cfg.Streams > maxStreams {
		return nil, fmt.Errorf("--streams %d: want 2 to %d", cfg.Streams, maxStreams)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	dir, mc, err := cfg.Model.Open(ctx)
	if err != nil {
		return nil, err
	}
	be, err := cfg.Backend.open()
	if err != nil {
		return nil, err
	}
	defer be.Close()
	maxCtx := cfg.PromptTokens + cfg.N + 8
	loadStart := time.Now()
	m, err := engine.Load(dir, engine.Options{Backend: be, First: 0, Last: -1, MaxContext: maxCtx})
	if err != nil {
		return nil, err
	}
	defer m.Close()
	loadS := time.Since(loadStart).Seconds()
	reg := prometheus.NewRegistry()
	srv := &node.Server{Model: m, Backend: be, Logger: log, MaxContext: maxCtx, MaxBatch: cfg.MaxBatch, Registry: reg}
	n, err := startBenchNode(ctx, srv, nil, link{}, log)
	if err != nil {
		return nil, err
	}
	defer n.Close()
	tr := &http.Transport{MaxIdleConnsPerHost: cfg.Streams + 1}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr}

	// Stream k's prompt: ids counting up from its own start, so no two
	// streams share a prefix; stream 0's is the one stream's prompt.
	prompt := func(k int) []int32 {
		ids := make([]int32, cfg.PromptTokens)
		for i := range ids {
			ids[i] = int32(1 + (k*cfg.PromptTokens+i)%(mc.Vocab-1))
		}
		return ids
	}
	type result struct {
		tokS  float64   // the best round's
		gaps  []float64 // every round's
		first []int32   // stream 0's ids in the best round
		calls float64   // forward calls, every round
		steps float64   // sessions in them
	}
	run := func(streams, tokens int) (tokS float64, gaps []float64, first []int32, err error) {
		g, gctx := errgroup.WithContext(ctx)
		var mu sync.Mutex
		start := time.Now()
		for k := 0; k < streams; k++ {
			g.Go(func() error {
				ids, samples, err := streamCompletion(gctx, hc, n.url, nil, prompt(k), tokens, "")
				if err != nil {
					return fmt.Errorf("stream %d of %d: %w", k+1, streams, err)
				}
				mu.Lock()
				defer mu.Unlock()
				gaps = append(gaps, samples...)
				if k == 0 {
					first = ids
				}
				return nil
			})
		}
		if err := g.Wait(); err != nil {
			return 0, nil, nil, err
		}
		return float64(streams*tokens) / time.Since(start).Seconds(), gaps, first, nil
	}
	// One short warm-up of each side: first-call costs (allocations, the
	// CUDA backend's graphs and workspaces) stay out of the timed runs.
	for _, s := range []int{1, cfg.Streams} {
		if _, _, _, err := run(s, 2); err != nil {
			return nil, fmt.Errorf("warm-up: %w", err)
		}
	}
	sides := []struct {
		series  string
		streams int
		res     result
	}{{SeriesOneStream, 1, result{}}, {SeriesConcurrent, cfg.Streams, result{}}}
	for r := 0; r < cfg.Rounds; r++ {
		for i := range sides {
			sd := &sides[i]
			c0, s0, err := batchHistogram(reg)
			if err != nil {
				return nil, err
			}
			tokS, gaps, first, err := run(sd.streams, cfg.N)
			if err != nil {
				return nil, fmt.Errorf("%s, round %d: %w", sd.series, r+1, err)
			}
			c1, s1, err := batchHistogram(reg)
			if err != nil {
				return nil, err
			}
			res := &sd.res
			res.gaps = append(res.gaps, gaps...)
			res.calls += c1 - c0
			res.steps += s1 - s0
			if tokS > res.tokS {
				res.tokS, res.first = tokS, first
			}
		}
	}

	one, conc := sides[0].res, sides[1].res
	rep := NewReport("streams", "concurrent streams", "ms/token", "one stream through the same node in the same run")
	rep.Notes = append(rep.Notes,
		fmt.Sprintf("model %s (%d layers, hidden %d, vocab %d) on %s (%s), all layers on one node (loaded in %.1f s); greedy /v1/completions streams of %d prompt + %d generated tokens; %d round(s), each side's best",
			dir, mc.NumLayers, mc.Hidden, mc.Vocab, be.Name(), be.Describe(), loadS, cfg.PromptTokens, cfg.N, cfg.Rounds),
		"tok_s: all streams' generated tokens over the wall time (prefill included); ratio: concurrent tok_s over one stream's; p50/p99: gaps between a stream's tokens",
		"calls, session_steps, mean_batch: the scheduler's forward calls over the timed runs (meshgpu_node_batch_sessions); ids_match: stream 0 generated the one stream's ids")
	if cfg.MaxBatch < 0 {
		rep.Notes = append(rep.Notes, "scheduler off: each step alone (MaxBatch < 0)")
	}
	for i, sd := range sides {
		ex := map[string]float64{"tok_s": sd.res.tokS, "calls": sd.res.calls, "session_steps": sd.res.steps}
		if sd.res.calls > 0 {
			ex["mean_batch"] = sd.res.steps / sd.res.calls
		}
		if i == 1 {
			ex["ratio"] = conc.tokS / one.tokS
			ex["ids_match"] = 0
			if slices.Equal(conc.first, one.first) {
				ex["ids_match"] = 1
			}
		}
		rep.Add(sd.series, float64(sd.streams), sd.res.gaps, ex)
	}
	return rep, nil
}

// batchHistogram reads the node's meshgpu_node_batch_sessions: forward
// calls and the sessions in them so far (0, 0 before the first call).
func batchHistogram(reg prometheus.Gatherer) (calls, sessions float64, err error) {
	fams, err := reg.Gather()
	if err != nil {
		return 0, 0, err
	}
	for _, f := range fams {
		if f.GetName() != "meshgpu_node_batch_sessions" {
			continue
		}
		for _, m := range f.GetMetric() {
			h := m.GetHistogram()
			calls += float64(h.GetSampleCount())
			sessions += h.GetSampleSum()
		}
	}
	return calls, sessions, nil
}
