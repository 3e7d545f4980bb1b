package bench

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"meshgpu/internal/testenv"
)

// The compute suites run on the CPU backend with tiny settings; a 16 MiB
// bandwidth baseline keeps them quick (it may sit in cache, which only
// makes the floor lower).
var smokeBackend = BackendConfig{Name: "cpu", Threads: 2, BaselineBytes: 16 << 20}

func TestKernelsSuite(t *testing.T) {
	rep, err := Kernels(context.Background(), KernelsConfig{Backend: smokeBackend, Shape: "tiny", N: 3, Contexts: []int{16, 64}})
	if err != nil {
		t.Fatal(err)
	}
	count := map[string]int{}
	for _, r := range rep.Rows {
		count[r.Series]++
		if r.P50 <= 0 || r.P99 < r.P50 {
			t.Errorf("row %+v: p50 must be positive and at most p99", r)
		}
		switch r.Series {
		case SeriesBWFloor:
		case SeriesMatmul:
			if r.Extra["gflops"] <= 0 {
				t.Errorf("row %+v has no GFLOP/s", r)
			}
		default:
			if r.Extra["gbps"] <= 0 {
				t.Errorf("row %+v has no achieved bandwidth", r)
			}
		}
	}
	want := map[string]int{SeriesMatvec: 3, SeriesMatmul: 3, SeriesBWFloor: 3, SeriesRMSNorm: 1, SeriesAttention: 2}
	for s, n := range want {
		if count[s] != n {
			t.Errorf("series %s: %d rows, want %d (all: %v)", s, count[s], n, count)
		}
	}
	// Attention over 64 cached positions reads 4x the bytes of 16.
	a16, ok1 := rep.Find(SeriesAttention, 2*16*2*16*4/float64(1<<20))
	a64, ok2 := rep.Find(SeriesAttention, 2*64*2*16*4/float64(1<<20))
	if !ok1 || !ok2 || a16.Extra["context"] != 16 || a64.Extra["context"] != 64 {
		t.Errorf("attention rows not at the KV bytes of their context: %+v %+v", a16, a64)
	}
}

func TestLayersSuite(t *testing.T) {
	cache := t.TempDir()
	rep, err := Layers(context.Background(), LayersConfig{Backend: smokeBackend, Model: ModelSource{Synth: "tiny:4", CacheDir: cache}, N: 3, Context: 8})
	if err != nil {
		t.Fatal(err)
	}
	var depths []float64
	for _, r := range rep.Rows {
		if r.Series == SeriesForward {
			depths = append(depths, r.X)
			floor, ok := rep.Find(SeriesBWFloor, r.X)
			if !ok || floor.P50 <= 0 || r.P50 <= 0 {
				t.Errorf("depth %v: forward %+v floor %+v", r.X, r, floor)
			}
		}
	}
	if !slices.Equal(depths, []float64{1, 4}) {
		t.Fatalf("depths %v, want [1 4] for a 4-layer model", depths)
	}
	one, _ := rep.Find(SeriesBWFloor, 1)
	four, _ := rep.Find(SeriesBWFloor, 4)
	if r := four.Extra["weight_MiB"] / one.Extra["weight_MiB"]; r < 3.99 || r > 4.01 {
		t.Errorf("4 layers weigh %.3fx one layer, want 4x", r)
	}
	// The synthesized model is cached: a second resolve does not rewrite it.
	dir, err := (ModelSource{Synth: "tiny:4", CacheDir: cache}).Resolve(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(cache)
	if len(entries) != 1 || filepath.Base(dir) != "tiny-4l" {
		t.Errorf("cache holds %v, want only tiny-4l", entries)
	}
}

func TestDecodeSuite(t *testing.T) {
	rep, err := Decode(context.Background(), DecodeConfig{Backend: smokeBackend, Model: ModelSource{Synth: "tiny", CacheDir: t.TempDir()}, N: 6, PromptTokens: 4})
	if err != nil {
		t.Fatal(err)
	}
	if got := rep.Series(); !slices.Equal(got, []string{"meshgpu-cpu", SeriesBWFloor}) {
		t.Fatalf("series %v", got)
	}
	r := rep.Rows[0]
	if r.N != 6 || r.Extra["tok_s"] <= 0 || r.Extra["gbps"] <= 0 {
		t.Errorf("decode row %+v", r)
	}
	if len(rep.Notes) == 0 || !slices.ContainsFunc(rep.Notes, func(n string) bool { return len(n) > 0 && n[:2] == "HF" }) {
		t.Errorf("no note on the skipped HF transformers rows: %v", rep.Notes)
	}
}

func TestMeshSuiteMatchesOneNode(t *testing.T) {
	src := ModelSource{Synth: "tiny:6", CacheDir: t.TempDir()}
	if dir := testenv.SharedDir(); dir != "" {
		if _, err := os.Stat(filepath.Join(dir, "models", "gocoder-6m", "config.json")); err == nil {
			src = ModelSource{Dir: filepath.Join(dir, "models", "gocoder-6m")}
		}
	}
	before := goroutines()
	rep, err := Mesh(context.Background(), MeshConfig{Backend: smokeBackend, Model: src, Nodes: 3, Relay: true, N: 6, PromptTokens: 8, HopDType: "f32"})
	if err != nil {
		t.Fatal(err)
	}
	if got := rep.Series(); !slices.Equal(got, []string{SeriesOneNode, SeriesMesh, SeriesMeshRelay}) {
		t.Fatalf("series %v", got)
	}
	// With f32 hops a split model on the CPU backend is bit-identical to one
	// node, so greedy decoding must produce the same ids.
	ref := rep.IDs[SeriesOneNode]
	if len(ref) != 6 {
		t.Fatalf("one node generated %v", ref)
	}
	for _, s := range []string{SeriesMesh, SeriesMeshRelay} {
		if !slices.Equal(rep.IDs[s], ref) {
			t.Errorf("%s generated %v, one node %v", s, rep.IDs[s], ref)
		}
	}
	m, _ := rep.Find(SeriesMesh, 3)
	mr, _ := rep.Find(SeriesMeshRelay, 3)
	for _, k := range []string{"compute_ms", "hop_ms", "nodes_compute_ms"} {
		if _, ok := m.Extra[k]; !ok {
			t.Errorf("mesh row lacks %s: %v", k, m.Extra)
		}
	}
	if _, ok := mr.Extra["relay_ms"]; !ok {
		t.Errorf("mesh-relay row lacks relay_ms: %v", mr.Extra)
	}
	if m.N != 5 || mr.N != 5 {
		t.Errorf("timed %d and %d tokens, want 5 each (the first carries the prefill)", m.N, mr.N)
	}
	checkGoroutines(t, before)
}

func TestReadTorchResultsAcceptsPythonNaN(t *testing.T) {
	p := filepath.Join(t.TempDir(), "bench.json")
	os.WriteFile(p, []byte(`{"copy_GBps": NaN, "1b.hf_eager_tok_s": 91.5, "x": -Infinity, "device": "H200"}`), 0o644)
	res, err := readTorchResults(p)
	if err != nil {
		t.Fatal(err)
	}
	if res["1b.hf_eager_tok_s"] != 91.5 || len(res) != 1 {
		t.Fatalf("got %v, want only the finite number", res)
	}
}

func TestRebaselineScalesFloors(t *testing.T) {
	rep := NewReport("decode", "GB", "ms/token", "")
	rep.Rows = []Row{
		{Series: "meshgpu-cpu", X: 1, P50: 100, Extra: map[string]float64{"pct_bw": 50}},
		{Series: SeriesBWFloor, X: 1, P50: 50, P99: 50, Mean: 50, Extra: map[string]float64{"gbps": 20, "tok_s": 20}},
	}
	// Rescale from 20 GB/s to a better second measurement of 40 GB/s.
	rescaleTo(rep, Bandwidth{GBps: 20}, Bandwidth{GBps: 40})
	f := rep.Rows[1]
	if f.P50 != 25 || f.Extra["gbps"] != 40 || f.Extra["tok_s"] != 40 || rep.Rows[0].Extra["pct_bw"] != 25 {
		t.Fatalf("rows after rescale: %+v %+v", rep.Rows[0], f)
	}
}

// The streams suite on a tiny model: both series, the ratio is the two
// rows' tok/s, every stream's tokens and forward calls are counted, one
// stream runs alone in every call, and batching (bit-identical on the CPU
// backend) does not change stream 0's greedy ids.
func TestStreamsSuite(t *testing.T) {
	before := goroutines()
	const streams, n, rounds = 4, 5, 2
	rep, err := Streams(context.Background(), StreamsConfig{Backend: smokeBackend, Model: ModelSource{Synth: "tiny", CacheDir: t.TempDir()},
		Streams: streams, N: n, PromptTokens: 4, Rounds: rounds})
	if err != nil {
		t.Fatal(err)
	}
	if got := rep.Series(); !slices.Equal(got, []string{SeriesOneStream, SeriesConcurrent}) {
		t.Fatalf("series %v", got)
	}
	one, ok1 := rep.Find(SeriesOneStream, 1)
	conc, ok2 := rep.Find(SeriesConcurrent, streams)
	if !ok1 || !ok2 {
		t.Fatalf("rows %+v", rep.Rows)
	}
	if one.Extra["tok_s"] <= 0 || conc.Extra["tok_s"] <= 0 || conc.Extra["ratio"] != conc.Extra["tok_s"]/one.Extra["tok_s"] {
		t.Errorf("ratio %v, want %v / %v", conc.Extra["ratio"], conc.Extra["tok_s"], one.Extra["tok_s"])
	}
	// n tokens per stream give n-1 gaps.
	if one.N != rounds*(n-1) || conc.N != rounds*streams*(n-1) {
		t.Errorf("gaps timed: %d and %d, want %d and %d", one.N, conc.N, rounds*(n-1), rounds*streams*(n-1))
	}
	if one.Extra["calls"] <= 0 || one.Extra["mean_batch"] != 1 {
		t.Errorf("one stream: %v forward calls of %v sessions on average, want some, all alone", one.Extra["calls"], one.Extra["mean_batch"])
	}
	if conc.Extra["session_steps"] != streams*one.Extra["session_steps"] || conc.Extra["mean_batch"] < 1 || conc.Extra["mean_batch"] > streams {
		t.Errorf("concurrent: %v session-steps (one stream: %v), mean batch %v", conc.Extra["session_steps"], one.Extra["session_steps"], conc.Extra["mean_batch"])
	}
	if conc.Extra["ids_match"] != 1 {
		t.Errorf("stream 0 generated other ids batched than alone")
	}
	checkGoroutines(t, before)
}

// The speculative comparison runs plain and speculative decoding on one
// head, and one pass at a time on a second, over emulated links: the texts
// agree, drafts were accepted, and a plain token pays the two round trips
// of a three-node chain. A random
// draft model (the default for draft) changes nothing in the text either.
func TestMeshSuiteSpeculates(t *testing.T) {
	src := ModelSource{Synth: "tiny:6", CacheDir: t.TempDir()}
	if dir := testenv.SharedDir(); dir != "" {
		if _, err := os.Stat(filepath.Join(dir, "models", "gocoder-6m", "config.json")); err == nil {
			src = ModelSource{Dir: filepath.Join(dir, "models", "gocoder-6m")}
		}
	}
	before := goroutines()
	const rtt = 4 * time.Millisecond
	rep, err := Mesh(context.Background(), MeshConfig{Backend: smokeBackend, Model: src, Nodes: 3, N: 12, PromptTokens: 8, HopDType: "f32",
		RTT: rtt, Speculate: "ngram"})
	if err != nil {
		t.Fatal(err)
	}
	series := SeriesMeshSpeculate + "-ngram"
	plain, ok1 := rep.Find(SeriesMeshPlain, 3)
	spec, ok2 := rep.Find(series, 3)
	one, ok3 := rep.Find(series+SeriesOnePass, 3)
	if !ok1 || !ok2 || !ok3 {
		t.Fatalf("series %v", rep.Series())
	}
	for _, r := range []Row{spec, one} {
		if r.Extra["texts_identical"] != 1 {
			t.Errorf("%s and plain texts differ: %v", r.Series, rep.IDs)
		}
		if r.Extra["tokens_per_pass"] <= 1 || r.Extra["speedup"] <= 0 {
			t.Errorf("%s: no draft accepted: %v", r.Series, r.Extra)
		}
	}
	chain, ok := rep.Find(SeriesMeshPlain+SuffixChain, 3)
	if !ok {
		t.Fatalf("series %v", rep.Series())
	}
	// Delays only add, so these floors hold on a loaded machine: four
	// one-way delays a token along the chain, three with direct replies
	// (the tail's link to the head is delayed too).
	if chain.P50 < 2*float64(rtt.Milliseconds())*0.9 {
		t.Errorf("a plain token took %.2f ms over links of %v with chain replies: the links are not delayed (want two round trips)", chain.P50, rtt)
	}
	if plain.P50 < 1.5*float64(rtt.Milliseconds())*0.9 {
		t.Errorf("a plain token took %.2f ms over links of %v with direct replies: the tail's link to the head is not delayed (want three one-way delays)", plain.P50, rtt)
	}
	rep, err = Mesh(context.Background(), MeshConfig{Backend: smokeBackend, Model: src, Nodes: 3, N: 6, PromptTokens: 8, HopDType: "f32",
		Speculate: "draft"})
	if err != nil {
		t.Fatal(err)
	}
	if d, ok := rep.Find(SeriesMeshSpeculate+"-draft", 3); !ok || d.Extra["texts_identical"] != 1 {
		t.Errorf("draft: %+v", d)
	}
	checkGoroutines(t, before)
}

func TestPrefillSuite(t *testing.T) {
	rep, err := Prefill(context.Background(), PrefillConfig{Backend: smokeBackend, Model: ModelSource{Synth: "tiny", CacheDir: t.TempDir()}, N: 2, PromptTokens: 24})
	if err != nil {
		t.Fatal(err)
	}
	if got := rep.Series(); !slices.Equal(got, []string{"meshgpu-cpu"}) {
		t.Fatalf("series %v", got)
	}
	r := rep.Rows[0]
	if r.N != 2 || r.X != 24 || r.Extra["tok_s"] <= 0 || r.Extra["best_tok_s"] < r.Extra["tok_s"] {
		t.Errorf("prefill row %+v", r)
	}
}
