package bench

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"

	"meshgpu/engine"
	"meshgpu/model"
	"meshgpu/node"
	"meshgpu/openai"
	"meshgpu/relay"
	"meshgpu/ticket"
	"meshgpu/wire"
)

// MeshConfig sizes the mesh suite.
type MeshConfig struct {
	Backend BackendConfig
	// Model is the model to serve (default: synthesized tiny:6; the CLI
	// prefers ../shared/models/gocoder-6m when it exists).
	Model ModelSource
	Nodes int  // nodes in the mesh (default 3)
	Relay bool // the last node is reached through a relay (also measured without it)
	N     int  // generated tokens timed per configuration (default 16)
	// PromptTokens is the prompt length (default 16).
	PromptTokens int
	// HopDType is the head's hop dtype, bf16 (default) or f32 (bit-identical
	// to one node on the CPU backend).
	HopDType string
	// RTT emulates a round-trip time on every link between nodes (the
	// client's connection to the head stays loopback).
	RTT time.Duration
	// Speculate (ngram or draft) adds two series over Go-code prompts from
	// the same head: plain decoding (the request turns speculation off)
	// and speculative decoding, with tok/s, the speedup and whether the
	// texts agree. DraftModel drafts for draft (default: a random model
	// with the target's vocabulary, one layer: drafts that are always
	// wrong, the worst case).
	Speculate    string
	DraftModel   ModelSource
	SpeculateMax int
	// Prompts, when set, are the texts of the prompt comparison instead
	// of goPrompts (ReadPrompts reads a file of them); with Speculate off
	// the comparison times plain decoding only.
	Prompts []string
	// SpeculateInFlight bounds the head's passes in flight (0: the node's
	// default); a second head over the same route, in the same run, sends
	// one pass at a time (series SeriesMeshSpeculate-mode-onepass).
	SpeculateInFlight int
	Logger            *slog.Logger
}

// Series of the mesh suite.
const (
	SeriesOneNode   = "one-node"
	SeriesMesh      = "mesh"
	SeriesMeshRelay = "mesh-relay"
	// SeriesMeshPlain and SeriesMeshSpeculate (+ "-" + mode) are the
	// speculative comparison over Go-code prompts.
	SeriesMeshPlain     = "mesh-plain"
	SeriesMeshSpeculate = "mesh-speculate"
	// SuffixChain marks a series of the prompt comparison whose tickets
	// name no head address: answers come back along the chain only, the
	// path before direct replies (node/directreply.go).
	SuffixChain = "-chain"
	// SeriesOnePass is the suffix of the one-pass-at-a-time series.
	SeriesOnePass = "-onepass"
)

// ReadPrompts reads a prompt file: a JSON list of strings.
func ReadPrompts(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var ps []string
	if err := json.Unmarshal(b, &ps); err != nil {
		return nil, fmt.Errorf("%s: want a JSON list of prompt strings: %v", path, err)
	}
	if len(ps) == 0 {
		return nil, fmt.Errorf("%s: no prompts", path)
	}
	for i, p := range ps {
		if strings.TrimSpace(p) == "" {
			return nil, fmt.Errorf("%s: prompt %d is empty", path, i)
		}
	}
	return ps, nil
}

// maxMeshRTT bounds --rtt for the mesh suite.
const maxMeshRTT = 2 * time.Second

// goPrompts are the Go-code prompts of the speculative comparison:
// ordinary code a completion continues (a function body, a method, a
// constructor of a struct, a String method, a second test), not repeated
// text. Prompt lookup gains what the output shares with the context: from
// about 1.2 tokens per pass (the constructor) to 5 (the test).
var goPrompts = []string{
	"package main\n\nimport (\n\t\"fmt\"\n\t\"os\"\n)\n\nfunc main() {\n\tif len(os.Args) < 2 {\n\t\tfmt.Println(\"usage: hello NAME\")\n\t\tos.Exit(1)\n\t}\n\t",
	"// Sum returns the sum of xs.\nfunc Sum(xs []int) int {\n\ttotal := 0\n\tfor _, x := range xs {\n\t\ttotal += x\n\t}\n\treturn total\n}\n\n// Max returns the largest of xs.\nfunc Max(xs []int) int {\n\t",
	"type Server struct {\n\tAddr    string\n\tHandler http.Handler\n\tLogger  *slog.Logger\n}\n\nfunc (s *Server) ListenAndServe() error {\n\tif s.Logger == nil {\n\t\t",
	"type Config struct {\n\tName    string\n\tAddr    string\n\tTimeout time.Duration\n\tRetries int\n}\n\n// NewConfig returns a Config with every field set.\nfunc NewConfig(name, addr string, timeout time.Duration, retries int) *Config {\n\treturn &Config{\n\t\tName:    name,\n\t\t",
	"const (\n\tKindA Kind = iota\n\tKindB\n\tKindC\n\tKindD\n)\n\nfunc (k Kind) String() string {\n\tswitch k {\n\tcase KindA:\n\t\treturn \"KindA\"\n\tcase KindB:\n\t\t",
	"func TestAdd(t *testing.T) {\n\tfor _, tc := range []struct {\n\t\ta, b, want int\n\t}{\n\t\t{1, 2, 3},\n\t\t{2, 2, 4},\n\t} {\n\t\tif got := Add(tc.a, tc.b); got != tc.want {\n\t\t\tt.Errorf(\"Add(%d, %d) = %d, want %d\", tc.a, tc.b, got, tc.want)\n\t\t}\n\t}\n}\n\nfunc TestSub(t *testing.T) {\n\t",
}

// MeshReport is the mesh suite's report plus the ids each configuration
// generated (greedy: they should agree).
type MeshReport struct {
	*Report
	IDs map[string][]int32
}

// Mesh starts nodes in-process on 127.0.0.1 over a model split into
// contiguous layer ranges, streams a greedy completion through the head's
// /v1/completions and times every token as its SSE chunk arrives. The same
// model on one node, in the same run, is the compute baseline: the mesh's
// extra time per token is hop time, and with Relay the route's last hop
// through the relay's tunnel (the node is then reached only that way) adds
// the relay time over the direct mesh.
func Mesh(ctx context.Context, cfg MeshConfig) (*MeshReport, error) {
	if cfg.Model.Dir == "" && cfg.Model.Synth == "" {
		cfg.Model.Synth = "tiny:6"
	}
	if cfg.Nodes <= 0 {
		cfg.Nodes = 3
	}
	if cfg.N <= 0 {
		cfg.N = 16
	}
	if cfg.PromptTokens <= 0 {
		cfg.PromptTokens = 16
	}
	if cfg.HopDType == "" {
		cfg.HopDType = "bf16"
	}
	if cfg.HopDType != "bf16" && cfg.HopDType != "f32" {
		return nil, fmt.Errorf("hop dtype %q: want bf16 or f32", cfg.HopDType)
	}
	if cfg.RTT < 0 || cfg.RTT > maxMeshRTT {
		return nil, fmt.Errorf("--rtt %v: want 0 (plain loopback) to %v", cfg.RTT, maxMeshRTT)
	}
	spec, err := wire.ParseSpeculateMode(cfg.Speculate)
	if err != nil {
		return nil, fmt.Errorf("--%v", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	dir, mc, err := cfg.Model.Open(ctx)
	if err != nil {
		return nil, err
	}
	if cfg.Nodes < 2 || cfg.Nodes > mc.NumLayers || cfg.Nodes > 16 {
		return nil, fmt.Errorf("--nodes %d: want 2 to %d (the model has %d layers)", cfg.Nodes, min(mc.NumLayers, 16), mc.NumLayers)
	}
	be, err := cfg.Backend.open()
	if err != nil {
		return nil, err
	}
	defer be.Close()
	maxCtx := cfg.PromptTokens + cfg.N + 8
	if spec != wire.SpeculateOff || len(cfg.Prompts) > 0 {
		maxCtx = max(maxCtx, 1024+cfg.N+8) // the Go prompts
	}
	lk := link{rtt: cfg.RTT}
	nodeClient := &http.Client{Transport: &http.Transport{DialContext: lk.dial(nil), MaxIdleConnsPerHost: 4, DisableCompression: true},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	defer nodeClient.CloseIdleConnections()

	var rl *benchRelay
	var rc *relay.Client
	if cfg.Relay {
		if rl, err = startRelay(log, link{}); err != nil {
			return nil, err
		}
		defer rl.Close()
		rc = &relay.Client{Logger: log}
		defer rc.Close()
	}
	// Every engine.Model and server is closed on the way out (deferred, so
	// in reverse): servers first, then the models, then the relay client
	// and relay.
	var models []*engine.Model
	defer func() {
		for _, m := range models {
			m.Close()
		}
	}()
	load := func(first, last int) (*engine.Model, error) {
		m, err := engine.Load(dir, engine.Options{Backend: be, First: first, Last: last, MaxContext: maxCtx})
		if err == nil {
			models = append(models, m)
		}
		return m, err
	}
	var nodes []*benchNode
	defer func() {
		for i := len(nodes) - 1; i >= 0; i-- {
			nodes[i].Close()
		}
	}()

	whole, err := load(0, mc.NumLayers-1)
	if err != nil {
		return nil, err
	}
	single, err := startBenchNode(ctx, &node.Server{Model: whole, Backend: be, Logger: log, MaxContext: maxCtx}, nil, link{}, log)
	if err != nil {
		return nil, err
	}
	nodes = append(nodes, single)

	var draft *engine.Model
	if spec == wire.SpeculateDraft {
		ddir, cleanup, err := draftModelDir(ctx, cfg.DraftModel, mc.Vocab)
		if err != nil {
			return nil, err
		}
		defer cleanup()
		if draft, err = engine.Load(ddir, engine.Options{Backend: be, Last: -1, MaxContext: maxCtx}); err != nil {
			return nil, fmt.Errorf("draft model: %w", err)
		}
		models = append(models, draft)
	}

	// The suite routes as a tracker does: it signs each request's route
	// as a ticket the nodes trust (node/tickets.go).
	_, trackerKey, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	trusted := func() []ed25519.PublicKey { return []ed25519.PublicKey{trackerKey.Public().(ed25519.PublicKey)} }
	var mesh []*benchNode
	var direct, relayed []wire.Hop
	for i, r := range splitLayers(mc.NumLayers, cfg.Nodes) {
		m, err := load(r[0], r[1])
		if err != nil {
			return nil, err
		}
		srv := &node.Server{Model: m, Backend: be, Logger: log, MaxContext: maxCtx, HopDType: cfg.HopDType, HTTPClient: nodeClient, TicketIssuers: trusted}
		if i == 0 {
			srv.Speculate, srv.DraftModel, srv.SpeculateMax, srv.SpeculateInFlight = spec, draft, cfg.SpeculateMax, cfg.SpeculateInFlight
		}
		var bridgeTo *benchRelay
		if cfg.Relay {
			srv.Relay = rc
			if i == cfg.Nodes-1 {
				bridgeTo = rl
			}
		}
		n, err := startBenchNode(ctx, srv, bridgeTo, link{}, log)
		if err != nil {
			return nil, err
		}
		nodes = append(nodes, n)
		mesh = append(mesh, n)
		if i == 0 {
			continue
		}
		h := wire.Hop{Endpoint: n.url, StartLayer: r[0], EndLayer: r[1], PeerID: n.srv.PeerID}
		direct = append(direct, h)
		if bridgeTo != nil {
			h = wire.Hop{StartLayer: r[0], EndLayer: r[1], PeerID: n.srv.PeerID, RelayAddr: rl.base + "/rpc/" + n.srv.PeerID}
		}
		relayed = append(relayed, h)
	}

	prompt := promptIDs(whole, cfg.PromptTokens)
	out := &MeshReport{IDs: map[string][]int32{}}
	rep := NewReport("mesh", "nodes", "ms/token", "the same model on one node in the same run (compute only)")
	out.Report = rep
	rep.Notes = append(rep.Notes, fmt.Sprintf("model %s (%d layers) on %s; %d nodes: %v; hops in %s; greedy, %d-token prompt",
		dir, mc.NumLayers, be.Name(), cfg.Nodes, splitLayers(mc.NumLayers, cfg.Nodes), cfg.HopDType, cfg.PromptTokens),
		"compute_ms: one-node p50; hop_ms: mesh p50 minus one-node p50; relay_ms: mesh-relay p50 minus mesh p50",
		"nodes_compute_ms: the sum over mesh nodes of /stats compute p50 (a cross-check of compute_ms)")

	runs := []struct {
		series string
		url    string
		route  []wire.Hop
		x      float64
	}{{SeriesOneNode, single.url, nil, 1}, {SeriesMesh, mesh[0].url, direct, float64(cfg.Nodes)}}
	if cfg.Relay {
		runs = append(runs, struct {
			series string
			url    string
			route  []wire.Hop
			x      float64
		}{SeriesMeshRelay, mesh[0].url, relayed, float64(cfg.Nodes)})
	}
	tr := &http.Transport{MaxIdleConnsPerHost: 2}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr}
	p50 := map[string]float64{}
	for _, run := range runs {
		// One short warm-up request, then the timed one.
		if _, _, err := streamCompletion(ctx, hc, run.url, routeTicket(trackerKey, mesh[0], run.route, true), prompt, 4, wire.SpeculateOff); err != nil {
			return nil, fmt.Errorf("%s: %w", run.series, err)
		}
		ids, samples, err := streamCompletion(ctx, hc, run.url, routeTicket(trackerKey, mesh[0], run.route, true), prompt, cfg.N, wire.SpeculateOff)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", run.series, err)
		}
		out.IDs[run.series] = ids
		row := rep.Add(run.series, run.x, samples, map[string]float64{})
		p50[run.series] = row.P50
		ex := rep.Rows[len(rep.Rows)-1].Extra
		if row.P50 > 0 {
			ex["tok_s"] = 1e3 / row.P50
		}
		switch run.series {
		case SeriesOneNode:
			ex["compute_ms"] = row.P50
		case SeriesMesh:
			ex["compute_ms"] = p50[SeriesOneNode]
			ex["hop_ms"] = row.P50 - p50[SeriesOneNode]
			ex["per_hop_ms"] = ex["hop_ms"] / float64(cfg.Nodes-1)
			var sum float64
			for _, n := range mesh {
				sum += n.srv.Stats().ComputeP50Ms
			}
			ex["nodes_compute_ms"] = sum
		case SeriesMeshRelay:
			ex["compute_ms"] = p50[SeriesOneNode]
			ex["hop_ms"] = p50[SeriesMesh] - p50[SeriesOneNode]
			ex["relay_ms"] = row.P50 - p50[SeriesMesh]
		}
	}
	if spec != wire.SpeculateOff || len(cfg.Prompts) > 0 {
		var one *benchNode
		if spec != wire.SpeculateOff {
			// The same head's layers, one pass at a time, over the same route.
			h := mesh[0].srv
			one, err = startBenchNode(ctx, &node.Server{Model: h.Model, Backend: be, Logger: log, MaxContext: maxCtx, HopDType: cfg.HopDType,
				HTTPClient: nodeClient, TicketIssuers: trusted, Speculate: spec, DraftModel: draft, SpeculateMax: cfg.SpeculateMax,
				SpeculateInFlight: 1}, nil, link{}, log)
			if err != nil {
				return nil, err
			}
			nodes = append(nodes, one)
		}
		if err := meshSpeculate(ctx, out, cfg, spec, hc, mesh[0], one, direct, trackerKey, whole); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// specRounds is how often the prompt comparison runs every prompt each
// way: the machine's noise is a few percent of a loopback token.
const specRounds = 2

// meshSpeculate times, on one head in one run, plain decoding with answers
// back along the chain (today's path before direct replies, the baseline),
// plain decoding with direct replies, and (Speculate set) speculative
// decoding both ways, over the prompts, alternating per prompt so drift
// hits all alike. Speculative tokens arrive in bursts, so tok/s is tokens
// over the time from each prompt's first token to its last (the mean
// gap), not the p50.
func meshSpeculate(ctx context.Context, out *MeshReport, cfg MeshConfig, spec wire.SpeculateMode, hc *http.Client, head, one *benchNode, route []wire.Hop, trackerKey ed25519.PrivateKey, m *engine.Model) error {
	prompts := cfg.Prompts
	if len(prompts) == 0 {
		prompts = goPrompts
	}
	type config struct {
		series                    string
		head                      *benchNode
		mode                      wire.SpeculateMode
		direct                    bool
		gaps                      []float64
		per                       []float64 // ms per prompt
		passes, accepted, drafted int64
		directFirst, chainFirst   int64
	}
	configs := []*config{{series: SeriesMeshPlain + SuffixChain, mode: wire.SpeculateOff}, {series: SeriesMeshPlain, mode: wire.SpeculateOff, direct: true}}
	if spec != wire.SpeculateOff {
		s := SeriesMeshSpeculate + "-" + string(spec)
		configs = append(configs, &config{series: s + SuffixChain, mode: spec}, &config{series: s + SeriesOnePass, head: one, mode: spec, direct: true},
			&config{series: s, mode: spec, direct: true})
	}
	for _, c := range configs {
		if c.head == nil {
			c.head = head
		}
		c.per = make([]float64, len(prompts))
	}
	identical := 1.0
	for r := 0; r < specRounds; r++ {
		for i, text := range prompts {
			prompt := m.Tokenizer.Encode(text, true)
			for _, h := range []*benchNode{head, one} { // warm-up of each head
				if h == nil {
					continue
				}
				if _, _, err := streamCompletion(ctx, hc, h.url, routeTicket(trackerKey, h, route, true), prompt, 4, spec); err != nil {
					return fmt.Errorf("prompt %d warm-up: %w", i, err)
				}
			}
			var ref []int32
			for _, c := range configs {
				before := c.head.srv.Stats()
				ids, gaps, err := streamCompletion(ctx, hc, c.head.url, routeTicket(trackerKey, c.head, route, c.direct), prompt, cfg.N, c.mode)
				if err != nil {
					return fmt.Errorf("%s, prompt %d: %w", c.series, i, err)
				}
				after := c.head.srv.Stats()
				c.passes += after.SpecPasses - before.SpecPasses
				c.accepted += after.SpecAccepted - before.SpecAccepted
				c.drafted += after.SpecDrafted - before.SpecDrafted
				c.directFirst += after.DirectReplies - before.DirectReplies
				c.chainFirst += after.DirectChainFirst - before.DirectChainFirst
				if ref == nil {
					ref = ids
				} else if !slices.Equal(ref, ids) {
					identical = 0
				}
				out.IDs[fmt.Sprintf("%s/%d", c.series, i)] = ids
				c.gaps = append(c.gaps, gaps...)
				c.per[i] += sum(gaps)
			}
		}
	}
	rep := out.Report
	// Per-token latency hides a speed-up that comes in bursts: chart tok/s.
	rep.PlotExtra, rep.PlotLabel = "tok_s", "tokens/s (higher is faster)"
	names := make([]string, len(configs))
	for i, c := range configs {
		names[i] = c.series
	}
	rep.Notes = append(rep.Notes, fmt.Sprintf("%s: the same head over %d prompts x %d rounds, %d tokens each, greedy, links with %v RTT (the tail's link to the head included); "+
		"series ending %s get tickets naming no head address (answers back along the chain, the baseline); series ending %s run on a second head with one pass in flight at a time; "+
		"the plain requests send \"meshgpu\":{\"speculate\":\"off\"}; tok_s = 1000 / mean ms between tokens; speedup: over %s",
		strings.Join(names, ", "), len(prompts), specRounds, cfg.N, cfg.RTT, SuffixChain, SeriesOnePass, configs[0].series))
	base := configs[0]
	x := float64(cfg.Nodes)
	for _, c := range configs {
		var per []string
		for i := range prompts {
			if c.per[i] > 0 {
				per = append(per, fmt.Sprintf("%.2f", base.per[i]/c.per[i]))
			}
		}
		if c != base {
			rep.Notes = append(rep.Notes, fmt.Sprintf("%s speedup per prompt (prompt order): %s", c.series, strings.Join(per, ", ")))
		}
		row := rep.Add(c.series, x, c.gaps, map[string]float64{})
		ex := rep.Rows[len(rep.Rows)-1].Extra
		if row.Mean > 0 {
			ex["tok_s"] = 1e3 / row.Mean
		}
		if bm := mean(base.gaps); row.Mean > 0 && bm > 0 {
			ex["speedup"] = bm / row.Mean
		}
		ex["texts_identical"] = identical
		if c.drafted > 0 {
			ex["accept_rate"] = float64(c.accepted) / float64(c.drafted)
		}
		if n := c.directFirst + c.chainFirst; n > 0 {
			ex["direct_first"] = float64(c.directFirst) / float64(n)
		}
		if c.passes > 0 {
			ex["tokens_per_pass"] = float64(c.accepted+c.passes) / float64(c.passes)
		}
	}
	return nil
}

func mean(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	return sum(xs) / float64(len(xs))
}

func sum(xs []float64) float64 {
	var s float64
	for _, x := range xs {
		s += x
	}
	return s
}

// draftModelDir is src, or (empty src) a random one-layer model with the
// target's vocabulary synthesized into a temporary directory.
func draftModelDir(ctx context.Context, src ModelSource, vocab int) (string, func(), error) {
	if src.Dir != "" || src.Synth != "" {
		dir, err := src.Resolve(ctx)
		return dir, func() {}, err
	}
	dir, err := os.MkdirTemp("", "meshgpu-draft-")
	if err != nil {
		return "", nil, err
	}
	cleanup := func() { os.RemoveAll(dir) }
	if _, err := model.Synth(ctx, dir, model.SynthOptions{Shape: "tiny", Layers: 1, Vocab: vocab, Seed: 1}); err != nil {
		cleanup()
		return "", nil, fmt.Errorf("synthesizing a draft model: %w", err)
	}
	return dir, cleanup, nil
}

// splitLayers cuts layers into n contiguous ranges, the larger ones first.
func splitLayers(layers, n int) [][2]int {
	out := make([][2]int, 0, n)
	first := 0
	for i := 0; i < n; i++ {
		size := layers / n
		if i < layers%n {
			size++
		}
		out = append(out, [2]int{first, first + size - 1})
		first += size
	}
	return out
}

// streamCompletion streams a greedy completion of n tokens from a head's
// /v1/completions and returns the ids and the time between consecutive
// tokens' chunks in ms (the first token, which carries the prefill, is not
// timed).
func streamCompletion(ctx context.Context, hc *http.Client, base string, ticketFor func() (string, error), prompt []int32, n int, spec wire.SpeculateMode) ([]int32, []float64, error) {
	fields := map[string]any{"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": true, "ignore_eos": true,
		"meshgpu": wire.Speculation{Speculate: string(spec)}}
	body, _ := json.Marshal(fields)
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return nil, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if ticketFor != nil {
		tk, err := ticketFor()
		if err != nil {
			return nil, nil, err
		}
		req.Header.Set(wire.HeaderTicket, tk)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		return nil, nil, fmt.Errorf("head answered %d: %s", resp.StatusCode, strings.TrimSpace(string(b)))
	}
	var ids []int32
	var samples []float64
	var last time.Time
	sr := openai.NewSSEReader(resp.Body, 1<<20)
	for {
		data, err := sr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return ids, samples, err
		}
		if data == openai.SSEDone {
			if len(ids) != n {
				return ids, samples, fmt.Errorf("stream ended after %d of %d tokens", len(ids), n)
			}
			return ids, samples, nil
		}
		now := time.Now()
		var chunk struct {
			openai.Completion
			Error *struct {
				Message, Type, Hop string
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			return ids, samples, fmt.Errorf("bad SSE chunk %.200q: %w", data, err)
		}
		if chunk.Error != nil {
			return ids, samples, fmt.Errorf("stream failed at hop %q: %s (%s)", chunk.Error.Hop, chunk.Error.Message, chunk.Error.Type)
		}
		if chunk.Meshgpu == nil {
			continue
		}
		if len(ids) > 0 {
			samples = append(samples, float64(now.Sub(last).Nanoseconds())/1e6)
		}
		ids = append(ids, chunk.Meshgpu.Token)
		last = now
	}
	return ids, samples, fmt.Errorf("stream ended without [DONE] after %d tokens", len(ids))
}

// routeTicket signs route after head as a fresh session's ticket, as the
// tracker's proxy does; nil for a run without a route. direct names the
// head's endpoint in it, so the tail also answers the head directly.
func routeTicket(key ed25519.PrivateKey, head *benchNode, route []wire.Hop, direct bool) func() (string, error) {
	if len(route) == 0 {
		return nil
	}
	return func() (string, error) {
		var b [12]byte
		rand.Read(b[:])
		now := time.Now()
		t := ticket.Ticket{SessionID: fmt.Sprintf("bench-%x", b), Head: head.srv.PeerID, IssuedAt: now, Expiry: now.Add(10 * time.Minute)}
		if direct {
			t.HeadEndpoint = head.url
		}
		for _, h := range route {
			t.Hops = append(t.Hops, ticket.Hop{PeerID: h.PeerID, Endpoint: h.Endpoint, RelayAddr: h.RelayAddr, First: h.StartLayer, Last: h.EndLayer})
		}
		raw, err := ticket.Sign(t, key)
		return ticket.String(raw), err
	}
}
