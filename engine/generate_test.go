package engine

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/sample"
)

// TestGoldenGreedy: for every golden prompt, the tokenizer gives the golden
// prompt ids and CPU greedy decoding gives fp32.greedy_ids (64 tokens) and
// greedy_text exactly.
func TestGoldenGreedy(t *testing.T) {
	dir := testenv.GoCoder(t)
	g := loadGolden(t, dir)
	m := loadModel(t, dir, openCPU(t), 0, -1)
	for i, gen := range g.Generations {
		if got := m.Tokenizer.Encode(gen.Prompt, true); !slices.Equal(got, gen.PromptIDs) {
			t.Errorf("prompt %d: tokenizer gives %v, golden %v", i, got, gen.PromptIDs)
		}
		var streamed string
		res, err := m.Generate(context.Background(), gen.PromptIDs, GenerateParams{MaxTokens: len(gen.FP32.GreedyIDs), IgnoreEOS: true},
			func(tk Token) error { streamed += tk.Text; return nil })
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(res.IDs, gen.FP32.GreedyIDs) {
			t.Errorf("prompt %d: ids\n got %v\nwant %v", i, res.IDs, gen.FP32.GreedyIDs)
		}
		if res.Text != gen.FP32.GreedyText || streamed != res.Text {
			t.Errorf("prompt %d: text %q, streamed %q, want %q", i, res.Text, streamed, gen.FP32.GreedyText)
		}
		if res.FinishReason != FinishLength || res.CompletionTokens != 64 || res.PromptTokens != len(gen.PromptIDs) {
			t.Errorf("prompt %d: finish %q, %d+%d tokens", i, res.FinishReason, res.PromptTokens, res.CompletionTokens)
		}
	}
}

// TestLegacyConfig loads gocoder with its transformers-4 config.json
// (rope_theta + rope_scaling) and expects the same greedy ids.
func TestLegacyConfig(t *testing.T) {
	dir := testenv.GoCoder(t)
	g := loadGolden(t, dir)
	tmp := t.TempDir()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		src := filepath.Join(dir, e.Name())
		if e.Name() == "config.json" || e.Name() == "tokenizer_config.json" {
			src = filepath.Join(dir, "legacy", e.Name())
		}
		abs, _ := filepath.Abs(src)
		if err := os.Symlink(abs, filepath.Join(tmp, e.Name())); err != nil {
			t.Fatal(err)
		}
	}
	m := loadModel(t, tmp, openCPU(t), 0, -1)
	gen := g.Generations[0]
	res, err := m.Generate(context.Background(), gen.PromptIDs, GenerateParams{MaxTokens: 64, IgnoreEOS: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(res.IDs, gen.FP32.GreedyIDs) {
		t.Errorf("legacy config: ids\n got %v\nwant %v", res.IDs, gen.FP32.GreedyIDs)
	}
}

// TestSplitStacks runs layers 0-2 and 3-5 as two stacks: with f32 hand-over
// the ids equal one stack's exactly; with bf16 the first 16 ids do.
func TestSplitStacks(t *testing.T) {
	dir := testenv.GoCoder(t)
	g := loadGolden(t, dir)
	be := openCPU(t)
	whole := loadModel(t, dir, be, 0, -1)
	a := loadModel(t, dir, be, 0, 2)
	b := loadModel(t, dir, be, 3, -1)
	if !a.HasEmbed() || a.HasHead() || b.HasEmbed() || !b.HasHead() {
		t.Fatalf("split stacks: embed/head flags wrong")
	}
	p := GenerateParams{MaxTokens: 64, IgnoreEOS: true}
	for i, gen := range g.Generations {
		one, err := whole.Generate(context.Background(), gen.PromptIDs, p, nil)
		if err != nil {
			t.Fatal(err)
		}
		f32, err := Decode(context.Background(), whole.Tokenizer, whole.EOS(), gen.PromptIDs, p, newChain(t, []*Model{a, b}, native.F32).Stepper(p.Sampling), nil)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(f32.IDs, one.IDs) {
			t.Errorf("prompt %d: f32 split\n got %v\nwant %v", i, f32.IDs, one.IDs)
		}
		bf, err := Decode(context.Background(), whole.Tokenizer, whole.EOS(), gen.PromptIDs, p, newChain(t, []*Model{a, b}, native.BF16).Stepper(p.Sampling), nil)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(bf.IDs[:16], one.IDs[:16]) {
			t.Errorf("prompt %d: bf16 split, first 16\n got %v\nwant %v", i, bf.IDs[:16], one.IDs[:16])
		}
	}
}

func newChain(t *testing.T, stages []*Model, hop native.DType) *Chain {
	t.Helper()
	c, err := NewChain(stages, 128, hop)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

func TestChainChecksStages(t *testing.T) {
	dir := testenv.GoCoder(t)
	be := openCPU(t)
	a := loadModel(t, dir, be, 0, 2)
	b := loadModel(t, dir, be, 4, -1)
	if _, err := NewChain([]*Model{a, b}, 16, native.F32); err == nil {
		t.Error("chain with a gap (0-2, 4-5): no error")
	}
	if _, err := NewChain([]*Model{a}, 16, native.F32); err == nil {
		t.Error("chain without the head: no error")
	}
}

// TestSampledSplitMatchesLocal: with temperature, top-p and a repetition
// penalty, a seeded generation is reproducible and the f32 split gives the
// same tokens as one stack (the draw depends only on seed, step and logits).
func TestSampledSplitMatchesLocal(t *testing.T) {
	dir := testenv.GoCoder(t)
	g := loadGolden(t, dir)
	be := openCPU(t)
	whole := loadModel(t, dir, be, 0, -1)
	a := loadModel(t, dir, be, 0, 3)
	b := loadModel(t, dir, be, 4, -1)
	p := GenerateParams{MaxTokens: 32, IgnoreEOS: true,
		Sampling: sample.Params{Temperature: 0.9, TopP: 0.95, RepetitionPenalty: 1.2, Seed: 77}}
	prompt := g.Generations[2].PromptIDs
	one, err := whole.Generate(context.Background(), prompt, p, nil)
	if err != nil {
		t.Fatal(err)
	}
	again, err := whole.Generate(context.Background(), prompt, p, nil)
	if err != nil {
		t.Fatal(err)
	}
	split, err := Decode(context.Background(), whole.Tokenizer, whole.EOS(), prompt, p, newChain(t, []*Model{a, b}, native.F32).Stepper(p.Sampling), nil)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(one.IDs, again.IDs) || !slices.Equal(one.IDs, split.IDs) {
		t.Errorf("sampled ids differ:\n one   %v\n again %v\n split %v", one.IDs, again.IDs, split.IDs)
	}
	if slices.Equal(one.IDs, g.Generations[2].FP32.GreedyIDs[:32]) {
		t.Error("sampling at temperature 0.9 gave exactly the greedy ids")
	}
	p.Sampling.Seed = 78
	other, err := whole.Generate(context.Background(), prompt, p, nil)
	if err != nil {
		t.Fatal(err)
	}
	if slices.Equal(one.IDs, other.IDs) {
		t.Error("seeds 77 and 78 gave the same 32 tokens")
	}
}
