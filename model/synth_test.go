package model

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Published shapes: Llama-3.2-1B has 1,235,814,400 parameters, Llama-3.1-8B
// 8,030,261,248 (their model cards / safetensors index total_size / 2).
func TestSynthShapesMatchPublishedSizes(t *testing.T) {
	for _, tc := range []struct {
		shape  string
		params int64
		tied   bool
	}{
		{"llama-3.2-1b", 1235814400, true},
		{"llama-3.1-8b", 8030261248, false},
	} {
		c, err := SynthConfig(tc.shape, 0)
		if err != nil {
			t.Fatal(err)
		}
		if got := c.TotalBytes(BF16); got != 2*tc.params {
			t.Errorf("%s: %d bytes, want %d", tc.shape, got, 2*tc.params)
		}
		if c.TieEmbeddings != tc.tied || c.Rope.Type != "llama3" || c.Vocab != 128256 {
			t.Errorf("%s: %+v", tc.shape, c)
		}
	}
	if _, err := SynthConfig("llama-70b", 0); err == nil || !strings.Contains(err.Error(), "tiny") {
		t.Errorf("unknown shape: %v", err)
	}
	if c, err := SynthConfig("llama-3.2-1b", 3); err != nil || c.NumLayers != 3 {
		t.Errorf("layers override: %v", err)
	}
}

func TestSynthTinyLoads(t *testing.T) {
	dir, cfg := synthTiny(t)
	loaded, err := LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	if loaded.Rope.Type != "default" || loaded.TieEmbeddings || loaded.NumLayers != 2 || loaded.Hidden != 64 {
		t.Fatalf("config.json: %+v", loaded)
	}
	ck, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if err := ck.Check(loaded, 0, loaded.NumLayers-1, true, true); err != nil {
		t.Fatal(err)
	}
	if n := len(ck.Names()); n != 1+9*2+2 {
		t.Fatalf("%d tensors", n)
	}
	// Values: norms near 1, matrices with std near 1/sqrt(in).
	stats := func(name string) (mean, std, lo, hi float64) {
		tt, err := ck.Tensor(name)
		if err != nil {
			t.Fatal(err)
		}
		lo, hi = math.Inf(1), math.Inf(-1)
		n := len(tt.Data) / 2
		var sum, sq float64
		for i := 0; i < n; i++ {
			v := float64(math.Float32frombits(uint32(binary.LittleEndian.Uint16(tt.Data[2*i:])) << 16))
			sum += v
			sq += v * v
			lo, hi = min(lo, v), max(hi, v)
		}
		mean = sum / float64(n)
		return mean, math.Sqrt(sq/float64(n) - mean*mean), lo, hi
	}
	if _, _, lo, hi := stats(LayerTensorName(1, AttnNorm)); lo < 0.94 || hi > 1.06 {
		t.Errorf("norm weights in [%g, %g], want near 1", lo, hi)
	}
	for _, tc := range []struct {
		name string
		in   int
	}{
		{LayerTensorName(0, QProj), cfg.Hidden},
		{LayerTensorName(0, DownProj), cfg.Intermediate},
		{LMHeadName, cfg.Hidden},
	} {
		mean, std, _, _ := stats(tc.name)
		want := 1 / math.Sqrt(float64(tc.in))
		if math.Abs(std-want) > 0.1*want || math.Abs(mean) > 0.1*want {
			t.Errorf("%s: mean %g std %g, want 0 and %g", tc.name, mean, std, want)
		}
	}

	// The tokenizer files are valid JSON whose special ids match config.json.
	var tok struct {
		AddedTokens []struct {
			ID      int    `json:"id"`
			Content string `json:"content"`
		} `json:"added_tokens"`
		Model struct {
			Vocab  map[string]int `json:"vocab"`
			Merges [][2]string    `json:"merges"`
		} `json:"model"`
	}
	data, err := os.ReadFile(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &tok); err != nil {
		t.Fatal(err)
	}
	if len(tok.AddedTokens) != 2 || tok.AddedTokens[0].ID != loaded.BOS || tok.AddedTokens[1].ID != loaded.EOS[0] ||
		tok.Model.Vocab[SynthBOS] != loaded.BOS || len(tok.Model.Vocab) > loaded.Vocab {
		t.Fatalf("tokenizer specials %+v, config bos %d eos %v", tok.AddedTokens, loaded.BOS, loaded.EOS)
	}
	ids := map[int]bool{}
	for _, id := range tok.Model.Vocab {
		ids[id] = true
	}
	if len(ids) != len(tok.Model.Vocab) {
		t.Fatal("tokenizer vocab has repeated ids")
	}
	for _, m := range tok.Model.Merges {
		if _, ok := tok.Model.Vocab[m[0]+m[1]]; !ok {
			t.Fatalf("merge %v makes a token not in the vocab", m)
		}
	}
	var tc map[string]any
	data, _ = os.ReadFile(filepath.Join(dir, "tokenizer_config.json"))
	if err := json.Unmarshal(data, &tc); err != nil || tc["bos_token"] != SynthBOS || tc["eos_token"] != SynthEOS {
		t.Fatalf("tokenizer_config.json: %v %v", tc, err)
	}
}

func TestSynthDeterministicAndSafe(t *testing.T) {
	dir, _ := synthTiny(t)
	a, _ := os.ReadFile(filepath.Join(dir, singleFile))

	// Existing files are not overwritten without Force.
	_, err := Synth(t.Context(), dir, SynthOptions{Shape: "tiny", Seed: 7})
	if err == nil || !strings.Contains(err.Error(), "already holds") {
		t.Fatalf("overwrite: %v", err)
	}
	b, _ := os.ReadFile(filepath.Join(dir, singleFile))
	if !bytes.Equal(a, b) {
		t.Fatal("refused synth changed the file")
	}
	// Same seed, same bytes (generation runs in parallel chunks).
	if _, err := Synth(t.Context(), dir, SynthOptions{Shape: "tiny", Seed: 7, Force: true}); err != nil {
		t.Fatal(err)
	}
	b, _ = os.ReadFile(filepath.Join(dir, singleFile))
	if !bytes.Equal(a, b) {
		t.Fatal("same seed wrote different bytes")
	}
	other := filepath.Join(t.TempDir(), "o")
	var calls int
	var last int64
	if _, err := Synth(t.Context(), other, SynthOptions{Shape: "tiny", Seed: 8, Layers: 3, Progress: func(done, total int64) {
		calls++
		last = done
		if done > total {
			t.Errorf("progress %d > total %d", done, total)
		}
	}}); err != nil {
		t.Fatal(err)
	}
	c, _ := os.ReadFile(filepath.Join(other, singleFile))
	if bytes.Equal(a[len(a)-1000:], c[len(c)-1000:]) {
		t.Fatal("different seeds wrote the same bytes")
	}
	cfg, err := LoadConfig(other)
	if err != nil || cfg.NumLayers != 3 || calls == 0 || last != cfg.TotalBytes(BF16) {
		t.Fatalf("layers override: %v %v, %d progress calls ending at %d", cfg, err, calls, last)
	}

	// A cancelled write leaves nothing behind.
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	gone := filepath.Join(t.TempDir(), "gone")
	if _, err := Synth(ctx, gone, SynthOptions{Shape: "tiny"}); err == nil {
		t.Fatal("cancelled synth succeeded")
	}
	entries, _ := os.ReadDir(gone)
	if len(entries) != 0 {
		t.Fatalf("cancelled synth left %v", entries)
	}
}

// BenchmarkSynthWeights measures weight generation (no disk) against a plain
// memory fill of the same buffer, as a ratio in one run.
func BenchmarkSynthWeights(b *testing.B) {
	cfg, _ := SynthConfig("llama-3.2-1b", 1)
	buf := make([]byte, 2*synthChunkElems)
	b.Run("fill", func(b *testing.B) {
		b.SetBytes(int64(len(buf)))
		for i := 0; b.Loop(); i++ {
			fillSynth(buf, cfg, LayerTensorName(0, QProj), 1, 0, uint64(i))
		}
	})
	b.Run("memset-baseline", func(b *testing.B) {
		b.SetBytes(int64(len(buf)))
		for i := 0; b.Loop(); i++ {
			for j := range buf {
				buf[j] = byte(i)
			}
		}
	})
}

// A vocabulary override writes embeddings and head of that many rows (a
// random draft model for a real model's vocabulary); one smaller than the
// synthesized tokenizer is refused.
func TestSynthVocabOverride(t *testing.T) {
	dir := t.TempDir()
	cfg, err := Synth(context.Background(), dir, SynthOptions{Shape: "tiny", Layers: 1, Vocab: 4096, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	got, err := LoadConfig(dir)
	if err != nil || cfg.Vocab != 4096 || got.Vocab != 4096 {
		t.Fatalf("vocab %d, config.json %v (%v); want 4096", cfg.Vocab, got, err)
	}
	ck, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if err := ck.Check(got, 0, got.NumLayers-1, true, true); err != nil {
		t.Fatal(err)
	}
	if _, err := Synth(context.Background(), t.TempDir(), SynthOptions{Shape: "tiny", Vocab: 100}); err == nil {
		t.Error("a vocabulary smaller than the tokenizer's was accepted")
	}
}
