package bench

import (
	"context"
	"fmt"
	"slices"
	"time"

	"meshgpu/engine"
	"meshgpu/native"
	"meshgpu/sample"
)

// PrefillConfig sizes the prefill suite.
type PrefillConfig struct {
	Backend BackendConfig
	// Model is the model to prefill (default: synthesized tiny).
	Model ModelSource
	N     int // timed prefills (default 3)
	// PromptTokens is the prompt length (default 512, llama-bench's pp512).
	PromptTokens int
}

// Prefill times a prompt of PromptTokens tokens through one stack holding
// the whole model in one forward call (embed, all layers, the last row's
// logits, as a generation's first step), N times on fresh sessions. tok_s
// is the prompt over the p50 time and best_tok_s over the fastest, the
// figure llama.cpp's context evaluation of the same tokens is compared
// with (scripts/bench-vs-llamacpp.sh).
func Prefill(ctx context.Context, cfg PrefillConfig) (*Report, error) {
	if cfg.Model.Dir == "" && cfg.Model.Synth == "" {
		cfg.Model.Synth = "tiny"
	}
	if cfg.N <= 0 {
		cfg.N = 3
	}
	if cfg.PromptTokens <= 0 {
		cfg.PromptTokens = 512
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
	m, err := engine.Load(dir, engine.Options{Backend: be, First: 0, Last: -1, MaxContext: cfg.PromptTokens})
	if err != nil {
		return nil, err
	}
	defer m.Close()
	ids := promptIDs(m, cfg.PromptTokens)
	dt := native.F32 // as decodeSteps: the dtype the backend computes in
	if be.Name() == "cuda" {
		dt = native.BF16
	}
	samples := make([]float64, 0, cfg.N)
	for i := 0; i < cfg.N; i++ {
		ms, err := prefillOnce(ctx, m, ids, dt)
		if err != nil {
			return nil, fmt.Errorf("prefill %d: %w", i, err)
		}
		samples = append(samples, ms)
	}
	rep := NewReport("prefill", "prompt tokens", "ms/prefill", "one forward call of the whole prompt")
	rep.Notes = append(rep.Notes, fmt.Sprintf("model %s (%d layers, hidden %d, vocab %d) on %s (%s); %d-token prompt, fresh session each time",
		dir, mc.NumLayers, mc.Hidden, mc.Vocab, be.Name(), be.Describe(), cfg.PromptTokens))
	row := rep.Add("meshgpu-"+be.Name(), float64(cfg.PromptTokens), samples, nil)
	tok := float64(cfg.PromptTokens)
	rep.Rows[len(rep.Rows)-1].Extra = map[string]float64{"tok_s": tok / (row.P50 / 1e3), "best_tok_s": tok / (slices.Min(samples) / 1e3)}
	return rep, nil
}

// prefillOnce runs ids through a fresh session and returns the time in ms.
func prefillOnce(ctx context.Context, m *engine.Model, ids []int32, dt native.DType) (float64, error) {
	sess, err := m.Stack.NewSession(len(ids))
	if err != nil {
		return 0, err
	}
	defer sess.Close()
	step := m.LocalStepper(sess, sample.Params{}, dt)
	t0 := time.Now()
	if _, _, err := step(ctx, 0, ids, 0); err != nil {
		return 0, err
	}
	return float64(time.Since(t0).Nanoseconds()) / 1e6, nil
}
