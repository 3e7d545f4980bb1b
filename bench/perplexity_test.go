package bench

import (
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/model"
	"meshgpu/model/gguf"
	"meshgpu/native"
)

// llamaCppReference is what llama.cpp's llama-perplexity computed on the
// GGUF files of gocoder-6m (its README says how).
type llamaCppReference struct {
	Files map[string]struct {
		PPL        float64 `json:"ppl"`
		Chunks     int     `json:"chunks"`
		MeanKLD    float64 `json:"mean_kld"`
		SameTopPct float64 `json:"same_top_pct"`
	} `json:"files"`
}

// gocoderPPL is gocoder-6m (safetensors), the text llama.cpp scored and
// llama.cpp's numbers.
func gocoderPPL(t *testing.T) (dir, text string, ref llamaCppReference) {
	t.Helper()
	dir = testenv.GoCoder(t)
	gg := testenv.Shared(t, "models/gocoder-6m-gguf")
	data, err := os.ReadFile(filepath.Join(gg, "reference.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &ref); err != nil {
		t.Fatal(err)
	}
	return dir, filepath.Join(gg, "ppl-text.txt"), ref
}

// The safetensors model holds the bf16 weights of gocoder-6m-bf16.gguf, and
// llama.cpp's f32 file is those weights upcast; computed in f32 on the CPU
// backend, meshgpu's perplexity of the same text must be llama.cpp's within
// 0.2% over the same 36 chunks. Against itself as --kl-base (whose short
// steps take decode's products, where the model's whole chunks take the
// prompt kernel's, which sums in another order) the divergence is below
// 1e-9, every top token agrees and the perplexities agree to 1e-6. f32
// products by name (the default may be avx512bf16's bf16 products), as the
// golden tests.
func TestPerplexityMatchesLlamaCpp(t *testing.T) {
	dir, text, ref := gocoderPPL(t)
	exact := smokeBackend
	exact.CPUISA = native.CPUISAF32()
	t.Cleanup(func() { native.SetCPUISA("") })
	rep, err := Perplexity(context.Background(), PerplexityConfig{Backend: exact, Model: ModelSource{Dir: dir},
		Base: ModelSource{Dir: dir}, File: text, Ctx: 128})
	if err != nil {
		t.Fatal(err)
	}
	f32, bf16 := ref.Files["f32"], ref.Files["bf16"]
	if rep.Chunks != f32.Chunks || rep.Chunks != 36 {
		t.Errorf("%d chunks, llama.cpp scored %d", rep.Chunks, f32.Chunks)
	}
	if rep.Scored != rep.Chunks*63 {
		t.Errorf("%d positions scored, want 63 per chunk (64 to 126) = %d", rep.Scored, rep.Chunks*63)
	}
	for name, want := range map[string]float64{"f32": f32.PPL, "bf16": bf16.PPL} {
		if d := math.Abs(rep.PPL/want - 1); d > 0.002 || want == 0 {
			t.Errorf("ppl %.5f, llama.cpp's %s %.5f: %.3f%% apart, want within 0.2%%", rep.PPL, name, want, 100*d)
		}
	}
	if rep.PPLErr <= 0 || rep.PPLErr > rep.PPL {
		t.Errorf("ppl uncertainty %v", rep.PPLErr)
	}
	if rep.MeanKLD == nil || rep.SameTopPct == nil || rep.BasePPL == nil {
		t.Fatalf("no KL numbers with --kl-base: %+v", rep)
	}
	if *rep.MeanKLD < 0 || *rep.MeanKLD >= 1e-9 || *rep.SameTopPct != 100 || math.Abs(*rep.BasePPL/rep.PPL-1) > 1e-6 {
		t.Errorf("against itself: mean KLD %g, same top %v%%, base ppl %v (model %v); want below 1e-9, 100, within 1e-6",
			*rep.MeanKLD, *rep.SameTopPct, *rep.BasePPL, rep.PPL)
	}
	var sb strings.Builder
	if err := rep.WriteJSON(&sb); err != nil {
		t.Fatal(err)
	}
	var js map[string]any
	if err := json.Unmarshal([]byte(sb.String()), &js); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"ppl", "chunks", "mean_kld", "same_top_pct", "tokens", "scored", "ctx", "backend", "elapsed_s", "suite", "rows"} {
		if _, ok := js[k]; !ok {
			t.Errorf("JSON lacks %s:\n%s", k, sb.String())
		}
	}
	t.Logf("ppl %.4f ± %.4f (llama.cpp f32 %.4f, bf16 %.4f), %d tokens, %.1fs", rep.PPL, rep.PPLErr, f32.PPL, bf16.PPL, rep.Tokens, rep.ElapsedS)
}

// TestPerplexityDefaultProducts: the default CPU path, and avx512bf16
// where the CPU has it, against the f32 --kl-base (which runs on f32
// products whatever the path: runBase). An f32 path agrees with the base
// exactly; avx512bf16 rounds bf16 weights' products' inputs to bf16, as
// llama.cpp's bf16 file does, so its divergence from the f32 base is above
// 0, no more than 1.1x llama.cpp's bf16 one, the top token agrees as often
// less one point, and the perplexity is llama.cpp's bf16 one within 0.2%.
func TestPerplexityDefaultProducts(t *testing.T) {
	dir, text, ref := gocoderPPL(t)
	t.Cleanup(func() { native.SetCPUISA("") })
	bf16 := ref.Files["bf16"]
	isas := []string{""}
	if native.CPUISADefault() != "avx512bf16" && slices.Contains(native.CPUISAs(), "avx512bf16") {
		isas = append(isas, "avx512bf16")
	}
	for _, isa := range isas {
		if err := native.SetCPUISA(isa); err != nil {
			t.Fatal(err)
		}
		path := native.CPUISA()
		rep, err := Perplexity(context.Background(), PerplexityConfig{Backend: smokeBackend, Model: ModelSource{Dir: dir},
			Base: ModelSource{Dir: dir}, File: text, Ctx: 128})
		if err != nil {
			t.Fatal(err)
		}
		kld, same, ppl := *rep.MeanKLD, *rep.SameTopPct, rep.PPL
		t.Logf("%s: mean KLD %.3g (llama.cpp bf16 %.3g), same top %.3f%% (%.3f%%), ppl %.5f (%.5f)",
			path, kld, bf16.MeanKLD, same, bf16.SameTopPct, ppl, bf16.PPL)
		if path != "avx512bf16" {
			if kld >= 1e-9 || same != 100 {
				t.Errorf("%s against the f32 base: mean KLD %g, same top %v%%; want 0, 100", path, kld, same)
			}
			continue
		}
		if !(kld > 1e-9) || kld > 1.1*bf16.MeanKLD || same < bf16.SameTopPct-1 {
			t.Errorf("bf16 products against the f32 base: mean KLD %g (want above 0, at most 1.1x llama.cpp's %g), same top %.3f%% (llama.cpp %.3f%%)",
				kld, bf16.MeanKLD, same, bf16.SameTopPct)
		}
		if d := math.Abs(ppl/bf16.PPL - 1); d > 0.002 {
			t.Errorf("ppl %.5f, llama.cpp's bf16 %.5f: %.3f%% apart, want within 0.2%%", ppl, bf16.PPL, 100*d)
		}
	}
}

// The scorer against a direct float64 computation on hand-made logits:
// softmax written out, -log p of the next token, KL summed term by term.
func TestPerplexityScorerArithmetic(t *testing.T) {
	type pos struct {
		model, base []float32
		next        int32
	}
	ps := []pos{
		{[]float32{1, 2, 3, 0.5}, []float32{1, 2, 3, 0.5}, 2},    // same: KL 0, same top
		{[]float32{0, 0, 0, 0}, []float32{4, 0, 0, 0}, 1},        // uniform vs peaked; top 0 vs 0 (first of equals)
		{[]float32{-1, 5, 2, 2}, []float32{3, -2, 1, 0}, 3},      // tops differ
		{[]float32{100, 101, 99, 100}, []float32{2, 1, 0, 1}, 0}, // large logits: shift by max; tops differ
	}
	direct := func(x []float32) []float64 {
		var z float64
		for _, v := range x {
			z += math.Exp(float64(v) - 100) // a fixed shift: all these logits are within 100 of it
		}
		p := make([]float64, len(x))
		for i, v := range x {
			p[i] = math.Exp(float64(v)-100) / z
		}
		return p
	}
	var s scorer
	var nlls, klds []float64
	for _, q := range ps {
		if !s.add(q.model, q.base, q.next) {
			t.Fatalf("add(%v) reported non-finite", q)
		}
		pm, pb := direct(q.model), direct(q.base)
		nlls = append(nlls, -math.Log(pm[q.next]))
		var kl float64
		for v := range pb {
			kl += pb[v] * math.Log(pb[v]/pm[v])
		}
		klds = append(klds, kl)
	}
	mean := func(x []float64) float64 {
		var m float64
		for _, v := range x {
			m += v
		}
		return m / float64(len(x))
	}
	se := func(x []float64) float64 {
		m := mean(x)
		var ss float64
		for _, v := range x {
			ss += (v - m) * (v - m)
		}
		return math.Sqrt(ss / float64(len(x)-1) / float64(len(x)))
	}
	near := func(what string, got, want float64) {
		t.Helper()
		if math.Abs(got-want) > 1e-12*max(1, math.Abs(want)) {
			t.Errorf("%s %.15g, direct %.15g", what, got, want)
		}
	}
	ppl, pplErr := s.ppl()
	near("ppl", ppl, math.Exp(mean(nlls)))
	near("ppl error", pplErr, math.Exp(mean(nlls))*se(nlls))
	kld, kldErr := s.meanKLD()
	near("mean kld", kld, mean(klds))
	near("kld error", kldErr, se(klds))
	if s.n != 4 || s.sameTopPct() != 50 {
		t.Errorf("%d positions, same top %v%%; want 4 and 50%% (positions 0 and 1 agree)", s.n, s.sameTopPct())
	}
	if s.add([]float32{0, float32(math.NaN())}, nil, 0) || s.n != 4 {
		t.Errorf("NaN logits were scored")
	}
}

// Bad input fails with one error that says what to fix.
func TestPerplexityBadInput(t *testing.T) {
	dir, text, _ := gocoderPPL(t)
	short := filepath.Join(t.TempDir(), "short.txt")
	os.WriteFile(short, []byte("package main\n\nfunc main() {}\n"), 0o644)
	cache := t.TempDir()
	// A random model of another vocabulary size, and one of gocoder's size
	// with a tokenizer of its own.
	otherVocab, err := (ModelSource{Synth: "tiny", CacheDir: cache}).Resolve(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	otherTok := filepath.Join(cache, "tiny-4096")
	if _, err := model.Synth(context.Background(), otherTok, model.SynthOptions{Shape: "tiny", Vocab: 4096, Seed: 1}); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		cfg  PerplexityConfig
		want string
	}{
		{PerplexityConfig{Model: ModelSource{Dir: dir}, File: short, Ctx: 128}, "fewer than one chunk of --ctx 128"},
		{PerplexityConfig{Model: ModelSource{Dir: dir}, File: text, Ctx: 127}, "--ctx 127: the chunk length must be even"},
		{PerplexityConfig{Model: ModelSource{Dir: dir}, File: text, Ctx: 2}, "--ctx 2: the chunk length must be even and 4"},
		{PerplexityConfig{Model: ModelSource{Dir: dir}, File: text, Ctx: -8}, "--ctx -8"},
		{PerplexityConfig{Model: ModelSource{Dir: dir}, Ctx: 128}, "--file"},
		{PerplexityConfig{Model: ModelSource{Dir: dir}, File: filepath.Join(cache, "none.txt"), Ctx: 128}, "--file"},
		{PerplexityConfig{File: text, Ctx: 128}, "--model"},
		{PerplexityConfig{Model: ModelSource{Dir: dir}, Base: ModelSource{Dir: otherVocab}, File: text, Ctx: 128}, "vocabulary of 512 tokens, the model's has 4096"},
		{PerplexityConfig{Model: ModelSource{Dir: dir}, Base: ModelSource{Dir: otherTok}, File: text, Ctx: 128}, "tokenizes the text differently"},
	}
	for _, c := range cases {
		c.cfg.Backend = smokeBackend
		_, err := Perplexity(context.Background(), c.cfg)
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%+v: error %v, want one line with %q", c.cfg, err, c.want)
		}
	}
}

// The bf16 GGUF scored against the safetensors directory as --kl-base: the
// perplexity llama.cpp reports for that file within 0.2%, and its mean KL
// divergence from the f32 computation within 1e-4 of llama.cpp's.
func TestPerplexityGGUFMatchesLlamaCpp(t *testing.T) {
	dir, text, ref := gocoderPPL(t)
	file := testenv.GoCoderGGUF(t, "bf16")
	rep, err := Perplexity(context.Background(), PerplexityConfig{Backend: smokeBackend, Model: ModelSource{Dir: file},
		Base: ModelSource{Dir: dir}, File: text, Ctx: 128})
	if err != nil {
		t.Fatal(err)
	}
	want := ref.Files["bf16"]
	if rep.Chunks != ref.Files["f32"].Chunks { // reference.json gives the count once
		t.Errorf("%d chunks, llama.cpp scored %d", rep.Chunks, ref.Files["f32"].Chunks)
	}
	if d := math.Abs(rep.PPL/want.PPL - 1); d > 0.002 {
		t.Errorf("ppl %.5f, llama.cpp's %.5f: %.3f%% apart", rep.PPL, want.PPL, 100*d)
	}
	if rep.MeanKLD == nil || math.Abs(*rep.MeanKLD-want.MeanKLD) > 1e-4 {
		t.Errorf("mean KLD %v, llama.cpp's %g", rep.MeanKLD, want.MeanKLD)
	}
	t.Logf("gguf bf16: ppl %.5f (llama.cpp %.5f), mean KLD %.3g (llama.cpp %.3g), same top %.3f%% (llama.cpp %.3f%%)",
		rep.PPL, want.PPL, *rep.MeanKLD, want.MeanKLD, *rep.SameTopPct, want.SameTopPct)
}

// Each quantized GGUF, its blocks loaded as they are, scored against the
// safetensors directory (the same weights unquantized, in f32) as
// --kl-base: perplexity at most 0.5% above llama.cpp's for that file (lower
// is fine), mean KL divergence at most 1.1x llama.cpp's, and the same top
// token at least as often as llama.cpp less one point. llama.cpp also
// rounds the activations to 8 bits in its products; this backend keeps them
// f32, so it may do better, not worse.
func TestPerplexityQuantizedGGUF(t *testing.T) {
	dir, text, ref := gocoderPPL(t)
	for _, name := range []string{"q8_0", "q6_k", "q5_k_m", "q4_k_m"} {
		t.Run(name, func(t *testing.T) {
			rep, err := Perplexity(context.Background(), PerplexityConfig{Backend: smokeBackend,
				Model: ModelSource{Dir: testenv.GoCoderGGUF(t, name)}, Base: ModelSource{Dir: dir}, File: text, Ctx: 128})
			if err != nil {
				t.Fatal(err)
			}
			want := ref.Files[name]
			if want.PPL == 0 || want.MeanKLD == 0 {
				t.Fatalf("reference.json has no numbers for %s", name)
			}
			if rep.Chunks != ref.Files["f32"].Chunks {
				t.Errorf("%d chunks, llama.cpp scored %d", rep.Chunks, ref.Files["f32"].Chunks)
			}
			if rep.PPL > want.PPL*1.005 {
				t.Errorf("ppl %.5f, more than 0.5%% above llama.cpp's %.5f", rep.PPL, want.PPL)
			}
			if rep.MeanKLD == nil || rep.SameTopPct == nil {
				t.Fatal("no KL numbers")
			}
			if *rep.MeanKLD > 1.1*want.MeanKLD {
				t.Errorf("mean KLD %.5g, more than 1.1x llama.cpp's %.5g", *rep.MeanKLD, want.MeanKLD)
			}
			if *rep.SameTopPct < want.SameTopPct-1 {
				t.Errorf("same top %.3f%%, below llama.cpp's %.3f%% less 1", *rep.SameTopPct, want.SameTopPct)
			}
			t.Logf("%s: ppl %.5f (llama.cpp %.5f, %+.2f%%), mean KLD %.5f (llama.cpp %.5f, %.2fx), same top %.3f%% (llama.cpp %.3f%%), %.1fs",
				name, rep.PPL, want.PPL, 100*(rep.PPL/want.PPL-1), *rep.MeanKLD, want.MeanKLD, *rep.MeanKLD/want.MeanKLD,
				*rep.SameTopPct, want.SameTopPct, rep.ElapsedS)
		})
	}
}

// The bf16 GGUF quantized by meshgpu's own quantizer (model.QuantizeGGUF,
// `meshgpu model quantize`) to q8_0 and q4_k_m: every tensor gets the type
// llama.cpp's file of that type gives it, and the file scores as the
// quantized files above must (against llama.cpp's numbers for its file).
func TestPerplexityOwnQuantization(t *testing.T) {
	dir, text, ref := gocoderPPL(t)
	for _, name := range []string{"q8_0", "q4_k_m"} {
		t.Run(name, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "gocoder-6m-"+name+".gguf")
			if err := model.QuantizeGGUF(context.Background(), testenv.GoCoderGGUF(t, "bf16"), out, name, false, nil); err != nil {
				t.Fatal(err)
			}
			ours, err := gguf.Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer ours.Close()
			theirs, err := gguf.Open(testenv.GoCoderGGUF(t, name))
			if err != nil {
				t.Fatal(err)
			}
			defer theirs.Close()
			for _, ti := range theirs.Tensors {
				if oi, ok := ours.Tensor(ti.Name); !ok || oi.Type != ti.Type {
					t.Errorf("%s: %s, llama.cpp's file has %s", ti.Name, oi.Type, ti.Type)
				}
			}
			rep, err := Perplexity(context.Background(), PerplexityConfig{Backend: smokeBackend,
				Model: ModelSource{Dir: out}, Base: ModelSource{Dir: dir}, File: text, Ctx: 128})
			if err != nil {
				t.Fatal(err)
			}
			want := ref.Files[name]
			if rep.PPL > want.PPL*1.005 || *rep.MeanKLD > 1.1*want.MeanKLD || *rep.SameTopPct < want.SameTopPct-1 {
				t.Errorf("ppl %.5f, mean KLD %.5g, same top %.3f%%; llama.cpp's file: %.5f, %.5g, %.3f%%",
					rep.PPL, *rep.MeanKLD, *rep.SameTopPct, want.PPL, want.MeanKLD, want.SameTopPct)
			}
			t.Logf("own %s: ppl %.5f (llama.cpp's file %.5f), mean KLD %.5f (%.5f), same top %.3f%% (%.3f%%)",
				name, rep.PPL, want.PPL, *rep.MeanKLD, want.MeanKLD, *rep.SameTopPct, want.SameTopPct)
		})
	}
}
