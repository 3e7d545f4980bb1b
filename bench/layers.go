package bench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"time"

	"meshgpu/engine"
	"meshgpu/native"
)

// LayersConfig sizes the layers suite.
type LayersConfig struct {
	Backend BackendConfig
	// Model is the model to run (default: synthesized tiny:16, quick on any CPU).
	Model ModelSource
	// Depths are the layer counts timed (default 1, 4, 16, 32; those above
	// the model's layer count are dropped, and the full depth is added).
	Depths []int
	N      int // timed decode steps per depth (default 20)
	// Context is the tokens already in the KV cache (default 64).
	Context int
}

// Series of the layers suite.
const SeriesForward = "forward"

// Layers times one decode step (one token, bf16 activations in and out, as a
// hop carries them) through the first d layers of a model for each depth d,
// with Context tokens already cached, against the bandwidth floor: the
// layers' weight bytes over the memory bandwidth measured in the same run.
// These are the per-layer-range costs the tracker's routing weighs.
func Layers(ctx context.Context, cfg LayersConfig) (*Report, error) {
	if cfg.Model.Dir == "" && cfg.Model.Synth == "" {
		cfg.Model.Synth = "tiny:16"
	}
	if cfg.N <= 0 {
		cfg.N = 20
	}
	if cfg.Context <= 0 {
		cfg.Context = 64
	}
	if len(cfg.Depths) == 0 {
		cfg.Depths = []int{1, 4, 16, 32}
	}
	dir, mc, err := cfg.Model.Open(ctx)
	if err != nil {
		return nil, err
	}
	depths := depthsFor(cfg.Depths, mc.NumLayers)
	if len(depths) == 0 {
		return nil, fmt.Errorf("no depth in %v fits the model's %d layers", cfg.Depths, mc.NumLayers)
	}
	deepest := depths[len(depths)-1]

	be, err := cfg.Backend.open()
	if err != nil {
		return nil, err
	}
	defer be.Close()
	bw, err := cfg.Backend.measureBandwidth(be)
	if err != nil {
		return nil, err
	}
	m, err := engine.Load(dir, engine.Options{Backend: be, First: 0, Last: deepest - 1, MaxContext: cfg.Context + 8})
	if err != nil {
		return nil, err
	}
	defer m.Close()
	sess, err := m.Stack.NewSession(cfg.Context + 8)
	if err != nil {
		return nil, err
	}
	defer sess.Close()

	rng := rand.New(rand.NewPCG(3, 4))
	rowBytes := mc.Hidden * native.BF16.Size()
	prefill := randBF16(rng, cfg.Context*mc.Hidden, 1)
	if err := m.Stack.Forward([]native.Step{{Session: sess, Pos: 0, NTokens: cfg.Context}}, 0, deepest-1, native.BF16, prefill, prefill); err != nil {
		return nil, fmt.Errorf("prefill of %d tokens: %w", cfg.Context, err)
	}
	in := randBF16(rng, mc.Hidden, 1)
	out := make([]byte, rowBytes)

	rep := NewReport("layers", "layers", "ms", bw.What)
	rep.Notes = append(rep.Notes, fmt.Sprintf("model %s (%d layers, hidden %d) on %s (%s); one token at position %d",
		dir, mc.NumLayers, mc.Hidden, be.Name(), be.Describe(), cfg.Context))
	for _, d := range depths {
		step := []native.Step{{Session: sess, Pos: cfg.Context, NTokens: 1}} // same position each time: the cache is redone, not grown
		samples := make([]float64, 0, cfg.N)
		for i := -2; i < cfg.N; i++ { // two warm-up steps
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			t0 := time.Now()
			if err := m.Stack.Forward(step, 0, d-1, native.BF16, in, out); err != nil {
				return nil, fmt.Errorf("%d layers: %w", d, err)
			}
			if i >= 0 {
				samples = append(samples, float64(time.Since(t0).Nanoseconds())/1e6)
			}
		}
		bytes, err := weightBytesPerToken(dir, mc, 0, d-1, false)
		if err != nil {
			return nil, err
		}
		floorMS := float64(bytes) / (bw.GBps * 1e9) * 1e3
		row := rep.Add(SeriesForward, float64(d), samples, map[string]float64{"weight_MiB": float64(bytes) / (1 << 20)})
		r := &rep.Rows[len(rep.Rows)-1]
		if row.P50 > 0 {
			r.Extra["gbps"] = float64(bytes) / (row.P50 * 1e-3) / 1e9
			r.Extra["pct_floor"] = 100 * floorMS / row.P50
		}
		rep.Rows = append(rep.Rows, Row{Series: SeriesBWFloor, X: float64(d), P50: floorMS, P99: floorMS, Mean: floorMS, N: 1,
			Extra: map[string]float64{"gbps": bw.GBps, "weight_MiB": float64(bytes) / (1 << 20)}})
	}
	if err := cfg.Backend.rebaseline(rep, be, bw); err != nil {
		return nil, err
	}
	return rep, nil
}

// depthsFor keeps the depths the model has and adds its full depth.
func depthsFor(want []int, layers int) []int {
	seen := map[int]bool{}
	var out []int
	for _, d := range append(append([]int(nil), want...), layers) {
		if d >= 1 && d <= layers && !seen[d] {
			seen[d] = true
			out = append(out, d)
		}
	}
	sort.Ints(out)
	return out
}
