package native

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"testing"

	"meshgpu/sample"
)

// TestCUDASamplerMatchesCPU runs the device sampler (kernels/sample.cu)
// and the CPU backend's (cpu_sample.c, itself bit-exact with Go's sample
// package) on the same logits, up to a Llama 3 vocabulary: the same ids,
// logprobs within 1e-5 (the sums are defined to the bit; log may differ
// in an ulp).
func TestCUDASamplerMatchesCPU(t *testing.T) {
	co := cudaOpsOrSkip(t)
	cpu := CPUOps()
	r := rand.New(rand.NewPCG(opsSeed(t), 21))
	for _, vocab := range []int{50, 1000, 40000, 128256} {
		n, bad, inexact := 0, 0, 0
		for kind := 0; kind < 4; kind++ {
			logits := testLogits(r, vocab, kind)
			hist := make([]int32, 64)
			for i := range hist {
				hist[i] = int32(r.IntN(vocab))
			}
			seeds := 8
			if vocab > 100000 {
				seeds = 3
			}
			for ci, p := range samplerCases {
				for seed := 0; seed < seeds; seed++ {
					p.Seed = r.Uint64()
					want, err := cpu.Sample(logits, p, hist, 20, seed)
					if err != nil {
						t.Fatal(err)
					}
					got, err := co.Sample(logits, p, hist, 20, seed)
					if err != nil {
						t.Fatal(err)
					}
					n++
					if got.Logprob != want.Logprob {
						inexact++
					}
					if !sameChoice(got, want) {
						bad++
						if bad <= 3 {
							t.Errorf("vocab %d kind %d case %d (%+v): cuda %+v, cpu %+v", vocab, kind, ci, p, got, want)
						}
					}
				}
			}
		}
		status := "ok"
		if bad > 0 {
			status = "FAIL"
		}
		fmt.Printf("PARITY sample    vocab %-6d %4d draws: %d differ, %d logprobs not bit-equal  %s\n", vocab, n, bad, inexact, status)
	}
}

func openCUDAOrSkip(t *testing.T) Backend {
	path := os.Getenv("MESHGPU_CUDA_LIB")
	if path == "" {
		t.Skip("MESHGPU_CUDA_LIB is not set: runs on a GPU host (scripts/device-check.sh)")
	}
	b, err := Open("cuda", Options{CUDALib: path})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// sepStep is the separate-calls path on one stack with a bf16 hop (what the
// CUDA backend computes in): Embed, Forward, Logits, then Go's sampler.
func sepStep(t *testing.T, st Stack, sess Session, hist *[]int32, pos int, tokens []int32, gen, draw int, p sample.Params) (sample.Choice, []float32) {
	t.Helper()
	cfg := st.Config()
	act := make([]byte, len(tokens)*cfg.Hidden*2)
	if err := st.Embed(tokens, BF16, act); err != nil {
		t.Fatal(err)
	}
	if err := st.Forward([]Step{{Session: sess, Pos: pos, NTokens: len(tokens)}}, cfg.First, cfg.Last, BF16, act, act); err != nil {
		t.Fatal(err)
	}
	logits := make([]float32, cfg.Vocab)
	if err := st.Logits(1, BF16, act[(len(tokens)-1)*cfg.Hidden*2:], logits); err != nil {
		t.Fatal(err)
	}
	*hist = append((*hist)[:pos], tokens...)
	return sample.Choose(slices.Clone(logits), p, *hist, gen, draw), logits
}

// TestCUDAEndsMatchSeparateCalls: on the CUDA backend, Decode (tokens in,
// device-sampled token out; a 40-token prefill, then decode steps through
// the graph path) against Embed + Forward + Logits + Go's sampler on the
// same stack; head_forward + tail_forward on a split against the whole
// stack; a batch of 8 Decode steps whose returned logits Go's sampler
// must reproduce.
func TestCUDAEndsMatchSeparateCalls(t *testing.T) {
	cb := openCUDAOrSkip(t)
	cfg := StackConfig{
		Hidden: 256, Intermediate: 512, Heads: 8, KVHeads: 2, HeadDim: 64, Vocab: 3000,
		NumLayers: 2, First: 0, Last: 1, HasEmbed: true, HasHead: true,
		MaxContext: 256, RMSEps: 1e-5,
		Rope: Rope{Type: RopeLlama3, Theta: 500000, Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OrigMaxPos: 256},
	}
	seed := opsSeed(t)
	tensors := randomTensors(cfg, seed)
	whole := shardStack(t, cb, cfg, tensors)
	ends := whole.(Ends)
	if !ends.HasEnds() {
		t.Fatal("the CUDA library lacks the ABI 3 calls")
	}
	r := rand.New(rand.NewPCG(seed, 5))
	prompt := make([]int32, 40)
	for i := range prompt {
		prompt[i] = int32(r.IntN(cfg.Vocab))
	}
	params := []sample.Params{{}, endsParams, {Temperature: 1, TopP: 0.95, Seed: 3, TopLogprobs: 2}}
	for pi, p := range params {
		refSess, _ := whole.NewSession(cfg.MaxContext)
		sess, _ := whole.NewSession(cfg.MaxContext)
		var hist []int32
		tokens, pos, bad := prompt, 0, 0
		for draw := 0; draw < 16; draw++ {
			want, wantLogits := sepStep(t, whole, refSess, &hist, pos, tokens, len(prompt), draw, p)
			logits := make([]float32, cfg.Vocab)
			got, err := ends.Decode([]TokenStep{{Session: sess, Pos: pos, Tokens: tokens, GeneratedFrom: len(prompt), Draw: draw,
				Params: p, Logits: logits}})
			if err != nil {
				t.Fatal(err)
			}
			if !sameChoice(got[0], want) || !slices.Equal(logits, wantLogits) {
				bad++
				t.Errorf("params %d draw %d: decode %+v, separate %+v (logits equal: %v)", pi, draw, got[0], want, slices.Equal(logits, wantLogits))
				break
			}
			pos += len(tokens)
			tokens = []int32{want.ID}
		}
		fmt.Printf("STACK ends: decode vs separate calls, params %d: %s\n", pi, map[bool]string{true: "ok", false: "FAIL"}[bad == 0])
		refSess.Close()
		sess.Close()
	}

	// head (embed + layer 0) and tail (layer 1 + head) vs the whole stack
	hcfg, tcfg := cfg, cfg
	hcfg.Last, hcfg.HasHead = 0, false
	tcfg.First, tcfg.HasEmbed = 1, false
	head, tail := shardStack(t, cb, hcfg, tensors).(Ends), shardStack(t, cb, tcfg, tensors).(Ends)
	hs, _ := head.(Stack).NewSession(cfg.MaxContext)
	ts, _ := tail.(Stack).NewSession(cfg.MaxContext)
	refSess, _ := whole.NewSession(cfg.MaxContext)
	var hist []int32
	tokens, pos, bad := prompt, 0, 0
	for draw := 0; draw < 12; draw++ {
		want, _ := sepStep(t, whole, refSess, &hist, pos, tokens, len(prompt), draw, endsParams)
		act := make([]byte, len(tokens)*cfg.Hidden*2)
		if err := head.HeadForward([]TokenStep{{Session: hs, Pos: pos, Tokens: tokens}}, 0, BF16, act); err != nil {
			t.Fatal(err)
		}
		step := TokenStep{Session: ts, Pos: pos, Tokens: tokens, GeneratedFrom: len(prompt), Draw: draw, Params: endsParams}
		if draw > 0 {
			step.Tokens, step.NTokens = nil, 1
		}
		got, err := tail.TailForward([]TokenStep{step}, 1, BF16, act)
		if err != nil {
			t.Fatal(err)
		}
		if !sameChoice(got[0], want) {
			bad++
			t.Errorf("draw %d: head+tail %+v, whole %+v", draw, got[0], want)
			break
		}
		pos += len(tokens)
		tokens = []int32{want.ID}
	}
	fmt.Printf("STACK ends: head_forward + tail_forward vs one stack: %s\n", map[bool]string{true: "ok", false: "FAIL"}[bad == 0])

	// batch 8 through the graph path: each step's device pick is Go's pick
	// on the logits the same call returned
	const B = 8
	sessions := make([]Session, B)
	hists := make([][]int32, B)
	steps := make([]TokenStep, B)
	for i := range steps {
		sessions[i], _ = whole.NewSession(cfg.MaxContext)
		toks := prompt[i:]
		hists[i] = slices.Clone(toks)
		p := endsParams
		p.Seed = uint64(i)
		steps[i] = TokenStep{Session: sessions[i], Tokens: toks, GeneratedFrom: len(toks), Params: p, Logits: make([]float32, cfg.Vocab)}
	}
	bad = 0
	for draw := 0; draw < 6 && bad == 0; draw++ {
		got, err := ends.Decode(steps)
		if err != nil {
			t.Fatal(err)
		}
		for i := range steps {
			want := sample.Choose(slices.Clone(steps[i].Logits), steps[i].Params, hists[i], steps[i].GeneratedFrom, draw)
			if !sameChoice(got[i], want) {
				bad++
				t.Errorf("batch row %d draw %d: device %+v, Go on its logits %+v", i, draw, got[i], want)
			}
			hists[i] = append(hists[i], got[i].ID)
			steps[i].Pos += len(steps[i].Tokens)
			steps[i].Tokens = []int32{got[i].ID}
			steps[i].Draw = draw + 1
		}
	}
	fmt.Printf("STACK ends: batch %d decode, device sampler vs Go on the returned logits: %s\n", B, map[bool]string{true: "ok", false: "FAIL"}[bad == 0])
}
