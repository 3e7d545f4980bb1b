package native

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"testing"
)

// TestCUDAStackMatchesCPU runs one random model on the CUDA and the CPU
// backends through the paths gocoder-6m does not reach: q/k/v biases, f16
// and f32 weights converted at load, a 600-token prefill (two chunks of the
// CUDA backend, the second attending to the first through the cache), a
// mixed batch (one decode row, one 20-token prefill: cuBLAS and both
// attention kernels in one call), batched single-token steps (the CUDA graph
// path) and logits for 20 rows (cuBLAS) and 2 rows (matrix-vector). The CUDA
// residual stream is bf16 (as HF bf16), the CPU's f32, so the bound is a
// relative L2 error, not bit equality.
func TestCUDAStackMatchesCPU(t *testing.T) {
	path := os.Getenv("MESHGPU_CUDA_LIB")
	if path == "" {
		t.Skip("MESHGPU_CUDA_LIB is not set: the CUDA stack comparison runs on a GPU host (scripts/device-check.sh)")
	}
	cb, err := Open("cuda", Options{CUDALib: path})
	if err != nil {
		t.Fatal(err)
	}
	defer cb.Close()
	pb, err := Open("cpu", Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer pb.Close()

	cfg := StackConfig{
		Hidden: 256, Intermediate: 512, Heads: 8, KVHeads: 2, HeadDim: 64, Vocab: 300,
		NumLayers: 3, First: 0, Last: 2, HasEmbed: true, HasHead: true, QKVBias: true,
		MaxContext: 1200, RMSEps: 1e-5,
		Rope: Rope{Type: RopeLlama3, Theta: 500000, Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OrigMaxPos: 256},
	}
	seed := opsSeed(t)
	tensors := mixedTensors(cfg, seed)
	stacks := make([]Stack, 2)
	for i, b := range []Backend{cb, pb} {
		st, err := b.NewStack(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		for _, ts := range tensors {
			if err := st.SetTensor(ts); err != nil {
				t.Fatalf("%s: %v", b.Name(), err)
			}
		}
		if err := st.Ready(); err != nil {
			t.Fatal(err)
		}
		stacks[i] = st
	}
	r := rand.New(rand.NewPCG(seed, 3))
	toks := func(n int) []int32 {
		out := make([]int32, n)
		for i := range out {
			out[i] = int32(r.IntN(cfg.Vocab))
		}
		return out
	}
	type pair struct{ a, b Session }
	newPair := func(max int) pair {
		var p pair
		var err error
		if p.a, err = stacks[0].NewSession(max); err != nil {
			t.Fatal(err)
		}
		if p.b, err = stacks[1].NewSession(max); err != nil {
			t.Fatal(err)
		}
		return p
	}
	A, B := newPair(1200), newPair(64)
	defer func() {
		for _, s := range []Session{A.a, A.b, B.a, B.b} {
			s.Close()
		}
	}()
	const tol = 3e-2
	// forward runs the same steps on both backends (f32 hand-over) and
	// compares the output rows.
	forward := func(what string, steps []struct {
		p      pair
		pos    int
		tokens []int32
	}) []float32 {
		var all []int32
		for _, s := range steps {
			all = append(all, s.tokens...)
		}
		outs := make([][]float32, 2)
		for i, st := range stacks {
			act := make([]byte, len(all)*cfg.Hidden*4)
			if err := st.Embed(all, F32, act); err != nil {
				t.Fatal(err)
			}
			var ns []Step
			for _, s := range steps {
				sess := s.p.a
				if i == 1 {
					sess = s.p.b
				}
				ns = append(ns, Step{Session: sess, Pos: s.pos, NTokens: len(s.tokens)})
			}
			if err := st.Forward(ns, cfg.First, cfg.Last, F32, act, act); err != nil {
				t.Fatalf("%s on %s: %v", what, []string{"cuda", "cpu"}[i], err)
			}
			outs[i] = f32s(act)
		}
		e := relErr(outs[0], outs[1])
		fmt.Printf("STACK %-44s rel L2 %.2e (< %.0e)\n", what, e, tol)
		if !(e < tol) {
			t.Errorf("%s: cuda vs cpu rel L2 %.3g, want < %g", what, e, tol)
		}
		return outs[1]
	}
	type step = struct {
		p      pair
		pos    int
		tokens []int32
	}
	forward("prefill 600 tokens (2 chunks)", []step{{A, 0, toks(600)}})
	forward("mixed: decode 1 + prefill 20", []step{{A, 600, toks(1)}, {B, 0, toks(20)}})
	for k := 0; k < 3; k++ {
		forward(fmt.Sprintf("batched decode, step %d (graph)", k), []step{{A, 601 + k, toks(1)}, {B, 20 + k, toks(1)}})
	}
	last := forward("retried hop at 601 (truncates)", []step{{A, 601, toks(1)}, {B, 20, toks(1)}})

	x := make([]float32, 0, 20*cfg.Hidden)
	for len(x) < 20*cfg.Hidden {
		x = append(x, last...)
	}
	x = x[:20*cfg.Hidden]
	for _, rows := range []int{2, 20} {
		in := bytesF32(x[:rows*cfg.Hidden])
		outs := make([][]float32, 2)
		for i, st := range stacks {
			outs[i] = make([]float32, rows*cfg.Vocab)
			if err := st.Logits(rows, F32, in, outs[i]); err != nil {
				t.Fatal(err)
			}
		}
		e := relErr(outs[0], outs[1])
		fmt.Printf("STACK %-44s rel L2 %.2e (< %.0e)\n", fmt.Sprintf("logits, %d rows", rows), e, tol)
		if !(e < tol) {
			t.Errorf("logits %d rows: cuda vs cpu rel L2 %.3g, want < %g", rows, e, tol)
		}
	}
}

// mixedTensors: random weights, matrices alternating f16 and f32 by layer,
// norms bf16, biases f32 (the CUDA backend converts all to bf16 at load).
func mixedTensors(cfg StackConfig, seed uint64) []Tensor {
	r := rand.New(rand.NewPCG(seed, 9))
	mk := func(kind TensorKind, layer int, dt DType, scale, base float64, shape ...int) Tensor {
		n := 1
		for _, d := range shape {
			n *= d
		}
		data := make([]byte, n*dt.Size())
		for i := 0; i < n; i++ {
			f := float32(base + r.NormFloat64()*scale)
			switch dt {
			case F16:
				binary.LittleEndian.PutUint16(data[2*i:], toF16(f))
			case BF16:
				binary.LittleEndian.PutUint16(data[2*i:], toBF16(f))
			default:
				binary.LittleEndian.PutUint32(data[4*i:], math.Float32bits(f))
			}
		}
		return Tensor{Kind: kind, Layer: layer, DType: dt, Shape: shape, Data: data}
	}
	h, q, kv, I := cfg.Hidden, cfg.Heads*cfg.HeadDim, cfg.KVHeads*cfg.HeadDim, cfg.Intermediate
	sh, sq, si := 1/math.Sqrt(float64(h)), 1/math.Sqrt(float64(q)), 1/math.Sqrt(float64(I))
	ts := []Tensor{mk(TokEmbed, -1, BF16, 1, 0, cfg.Vocab, h)}
	for l := cfg.First; l <= cfg.Last; l++ {
		dt := F16
		if l%2 == 1 {
			dt = F32
		}
		ts = append(ts,
			mk(AttnNorm, l, BF16, 0.1, 1, h), mk(WQ, l, dt, sh, 0, q, h), mk(WK, l, dt, sh, 0, kv, h),
			mk(WV, l, dt, sh, 0, kv, h), mk(BQ, l, F32, 0.1, 0, q), mk(BK, l, F32, 0.1, 0, kv),
			mk(BV, l, F32, 0.1, 0, kv), mk(WO, l, dt, sq, 0, h, q), mk(MLPNorm, l, BF16, 0.1, 1, h),
			mk(WGate, l, dt, sh, 0, I, h), mk(WUp, l, dt, sh, 0, I, h), mk(WDown, l, dt, si, 0, h, I))
	}
	return append(ts, mk(FinalNorm, -1, BF16, 0.1, 1, h), mk(LMHead, -1, BF16, sh, 0, cfg.Vocab, h))
}

func f32s(b []byte) []float32 {
	out := make([]float32, len(b)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

func bytesF32(x []float32) []byte {
	out := make([]byte, 4*len(x))
	for i, v := range x {
		binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(v))
	}
	return out
}

// relErr is ||got - want|| / ||want||; NaN or a length mismatch is +Inf.
func relErr(got, want []float32) float64 {
	if len(got) != len(want) {
		return math.Inf(1)
	}
	var d, n float64
	for i := range want {
		if math.IsNaN(float64(got[i])) {
			return math.Inf(1)
		}
		e := float64(got[i]) - float64(want[i])
		d += e * e
		n += float64(want[i]) * float64(want[i])
	}
	return math.Sqrt(d / n)
}

// openBoth opens the CUDA backend (or skips) and the CPU backend.
func openBoth(t *testing.T) (cuda, cpu Backend) {
	t.Helper()
	path := os.Getenv("MESHGPU_CUDA_LIB")
	if path == "" {
		t.Skip("MESHGPU_CUDA_LIB is not set: CUDA backend checks run on a GPU host (scripts/device-check.sh)")
	}
	cb, err := Open("cuda", Options{CUDALib: path})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cb.Close() })
	pb, err := Open("cpu", Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pb.Close() })
	return cb, pb
}

// TestCUDATiedHeadComparesBytes: the CUDA backend may share the embedding's
// device copy with the LM head only when the bytes are equal. A caller is
// free to reuse a host buffer after set_tensor, so an LM head passed at the
// embedding's old address with other contents must get its own copy (the
// CPU backend compares bytes; the logits must agree with it).
func TestCUDATiedHeadComparesBytes(t *testing.T) {
	cb, pb := openBoth(t)
	cfg := StackConfig{
		Hidden: 64, Intermediate: 128, Heads: 2, KVHeads: 1, HeadDim: 32, Vocab: 100,
		NumLayers: 1, First: 0, Last: -1, HasEmbed: true, HasHead: true,
		MaxContext: 16, RMSEps: 1e-5, Rope: Rope{Type: RopeDefault, Theta: 10000},
	}
	r := rand.New(rand.NewPCG(opsSeed(t), 4))
	buf := make([]byte, cfg.Vocab*cfg.Hidden*2)
	fill := func() {
		for i := 0; i < len(buf); i += 2 {
			binary.LittleEndian.PutUint16(buf[i:], toBF16(float32(r.NormFloat64()*0.1)))
		}
	}
	norm := make([]byte, cfg.Hidden*2)
	for i := 0; i < len(norm); i += 2 {
		binary.LittleEndian.PutUint16(norm[i:], toBF16(1))
	}
	x := bytesF32(randActs(r, 2*cfg.Hidden, 1))
	fill()
	embed := append([]byte(nil), buf...)
	var outs [2][]float32
	for i, b := range []Backend{cb, pb} {
		st, err := b.NewStack(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		copy(buf, embed)
		for _, ts := range []Tensor{
			{Kind: TokEmbed, Layer: -1, DType: BF16, Shape: []int{cfg.Vocab, cfg.Hidden}, Data: buf},
			{Kind: FinalNorm, Layer: -1, DType: BF16, Shape: []int{cfg.Hidden}, Data: norm},
		} {
			if err := st.SetTensor(ts); err != nil {
				t.Fatal(err)
			}
		}
		// The same buffer, reused for other (equal on both backends) head weights.
		r2 := rand.New(rand.NewPCG(7, 7))
		for j := 0; j < len(buf); j += 2 {
			binary.LittleEndian.PutUint16(buf[j:], toBF16(float32(r2.NormFloat64()*0.1)))
		}
		if err := st.SetTensor(Tensor{Kind: LMHead, Layer: -1, DType: BF16, Shape: []int{cfg.Vocab, cfg.Hidden}, Data: buf}); err != nil {
			t.Fatal(err)
		}
		if err := st.Ready(); err != nil {
			t.Fatal(err)
		}
		outs[i] = make([]float32, 2*cfg.Vocab)
		if err := st.Logits(2, F32, x, outs[i]); err != nil {
			t.Fatal(err)
		}
	}
	if e := relErr(outs[0], outs[1]); !(e < 3e-2) {
		t.Errorf("logits with an LM head passed in the embedding's buffer: cuda vs cpu rel L2 %.3g, want < 3e-2", e)
	}
}

// TestCUDAConfigStatusesMatchCPU: configurations the CPU backend rejects
// get the same status from the CUDA backend (sizes past the CPU's bounds
// would overflow int arithmetic or the attention grid on the GPU).
func TestCUDAConfigStatusesMatchCPU(t *testing.T) {
	cb, pb := openBoth(t)
	base := StackConfig{
		Hidden: 64, Intermediate: 128, Heads: 2, KVHeads: 1, HeadDim: 32, Vocab: 100,
		NumLayers: 1, First: 0, Last: 0, HasEmbed: true, HasHead: true,
		MaxContext: 16, RMSEps: 1e-5, Rope: Rope{Type: RopeDefault, Theta: 10000},
	}
	for _, c := range []struct {
		name string
		edit func(*StackConfig)
	}{
		{"rope type 7", func(c *StackConfig) { c.Rope.Type = 7 }},
		{"hidden 2^21", func(c *StackConfig) { c.Hidden = 1 << 21 }},
		{"heads*head_dim 2^21", func(c *StackConfig) { c.Heads, c.KVHeads = 1<<16, 1<<13 }},
		{"vocab 2^24+8", func(c *StackConfig) { c.Vocab = 1<<24 + 8 }},
		{"max context 2^25", func(c *StackConfig) { c.MaxContext = 1 << 25 }},
		{"200000 layers", func(c *StackConfig) { c.NumLayers = 200000 }},
	} {
		cfg := base
		c.edit(&cfg)
		var st [2]Status
		for i, b := range []Backend{cb, pb} {
			s, err := b.NewStack(cfg)
			if err == nil {
				s.Close()
			}
			var e *Error
			if errors.As(err, &e) {
				st[i] = e.Status
			}
		}
		if st[1] == StatusOK {
			t.Fatalf("%s: the cpu backend accepts it; the case is wrong", c.name)
		}
		if st[0] != st[1] {
			t.Errorf("%s: cuda status %v, cpu %v", c.name, st[0], st[1])
		}
	}
}

// The CUDA settings reach the kernels: on one random stack, a 20-token
// prefill and a decode step under each setting stay within the CPU's
// bound, the f32 numerics and the tiled prefill kernel give other bits than
// the defaults, and out-of-range options get the CPU backend's status.
func TestCUDABackendOptions(t *testing.T) {
	path := os.Getenv("MESHGPU_CUDA_LIB")
	if path == "" {
		t.Skip("MESHGPU_CUDA_LIB is not set: CUDA backend checks run on a GPU host (scripts/device-check.sh)")
	}
	api, err := loadCUDAAPI(Options{CUDALib: path})
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range []backendOptions{{attention: 2}, {prefillAttention: -1}, {noGraphs: 2}, {batchMMA: 2}, {fusedDecode: 2}, {device: -1}} {
		b, err := openAPI(api, "cuda", o)
		if err == nil {
			b.Close()
		}
		if !IsStatus(err, StatusInvalidArgument) {
			t.Errorf("cuda backend_open %+v: %v, want invalid argument (as cpu)", o, err)
		}
	}
	cfg := StackConfig{
		Hidden: 256, Intermediate: 512, Heads: 8, KVHeads: 2, HeadDim: 64, Vocab: 300,
		NumLayers: 2, First: 0, Last: 1, HasEmbed: true, HasHead: true,
		MaxContext: 64, RMSEps: 1e-5, Rope: Rope{Type: RopeDefault, Theta: 10000},
	}
	prompt := make([]int32, 20)
	for i := range prompt {
		prompt[i] = int32((i*37 + 5) % cfg.Vocab)
	}
	outputs := func(be Backend) (prefill, decode []float32) {
		st := newStack(t, be, cfg, 11)
		defer st.Close()
		sess, err := st.NewSession(64)
		if err != nil {
			t.Fatal(err)
		}
		return f32s(run(t, st, sess, 0, prompt, F32)), f32s(run(t, st, sess, len(prompt), []int32{42}, F32))
	}
	pb, err := Open("cpu", Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer pb.Close()
	wantP, wantD := outputs(pb)
	got := map[string][2][]float32{}
	for name, cs := range map[string]CUDASettings{"default": {}, "f32": {AttentionF32: true}, "tiled": {PrefillTiled: true},
		"no-graphs": {NoGraphs: true}} {
		cb, err := Open("cuda", Options{CUDALib: path, CUDA: cs})
		if err != nil {
			t.Fatal(err)
		}
		p, d := outputs(cb)
		cb.Close()
		if e := relErr(p, wantP); e > 3e-2 {
			t.Errorf("%s: prefill rel err %.3g against cpu", name, e)
		}
		if e := relErr(d, wantD); e > 3e-2 {
			t.Errorf("%s: decode rel err %.3g against cpu", name, e)
		}
		got[name] = [2][]float32{p, d}
	}
	same := func(a, b []float32) bool {
		for i := range a {
			if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
				return false
			}
		}
		return true
	}
	if same(got["f32"][0], got["default"][0]) {
		t.Error("AttentionF32 gave the default's prefill bits: the setting did not reach the attention kernels")
	}
	if same(got["tiled"][0], got["default"][0]) {
		t.Error("PrefillTiled gave the default's prefill bits: the setting did not reach the prefill attention")
	}
}
