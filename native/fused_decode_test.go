package native

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"testing"
)

// ropeAttentionCase is one shape of the fused decode attention's op row.
type ropeAttentionCase struct {
	name               string
	n, pos, H, KVH, hd int
	rp                 Rope
}

var ropeAttentionCases = []ropeAttentionCase{
	{"1 row at 0 hd32", 1, 0, 8, 2, 32, Rope{Type: RopeDefault, Theta: 10000}},
	{"1 row at 999 hd64 gqa4", 1, 999, 8, 2, 64, Rope{Type: RopeDefault, Theta: 10000}},
	{"1 row at 8191 hd128 gqa4 llama3", 1, 8191, 32, 8, 128,
		Rope{Type: RopeLlama3, Theta: 500000, Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OrigMaxPos: 8192}},
	{"8 rows at 300 hd128 gqa8", 8, 300, 8, 1, 128, Rope{Type: RopeDefault, Theta: 500000}},
	{"16 rows at 64 hd64 mha", 16, 64, 4, 4, 64, Rope{Type: RopeDefault, Theta: 10000}},
}

// ropeAttentionInputs draws q, the new key and value rows and the caches.
func ropeAttentionInputs(r *rand.Rand, c ropeAttentionCase) (q, kn, vn, k, v []float32) {
	q = randActs(r, c.n*c.H*c.hd, 1)
	kn = randActs(r, c.n*c.KVH*c.hd, 1)
	vn = randActs(r, c.n*c.KVH*c.hd, 1)
	k = randActs(r, c.n*(c.pos+1)*c.KVH*c.hd, 1)
	v = randActs(r, c.n*(c.pos+1)*c.KVH*c.hd, 1)
	return
}

// The CPU table's rope_attention against Go: rope on q and the new key, the
// append, then attention over each row's own cache.
func TestOpsCPURopeAttention(t *testing.T) {
	r := rand.New(rand.NewPCG(opsSeed(t), 5))
	o := CPUOps()
	for _, c := range []ropeAttentionCase{
		{"3 rows at 20", 3, 20, 4, 2, 16, Rope{Type: RopeDefault, Theta: 10000}},
		{"1 row at 0", 1, 0, 2, 1, 8, Rope{Type: RopeDefault, Theta: 10000}},
		{"2 rows at 70 llama3", 2, 70, 4, 4, 32,
			Rope{Type: RopeLlama3, Theta: 500000, Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OrigMaxPos: 64}},
	} {
		q, kn, vn, k, v := ropeAttentionInputs(r, c)
		kw, vw := append([]float32(nil), k...), append([]float32(nil), v...)
		got, err := o.RopeAttention(q, kn, vn, k, v, c.n, c.pos, c.H, c.KVH, c.hd, c.rp, CUDASettings{})
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		kvn := c.KVH * c.hd
		pos := []int32{int32(c.pos)}
		var want, wantK []float64
		for i := 0; i < c.n; i++ {
			qi := narrow(refRope(q[i*c.H*c.hd:(i+1)*c.H*c.hd], 1, c.H, c.hd, pos, c.rp))
			ki := narrow(refRope(kn[i*kvn:(i+1)*kvn], 1, c.KVH, c.hd, pos, c.rp))
			kc := kw[i*(c.pos+1)*kvn : (i+1)*(c.pos+1)*kvn]
			vc := vw[i*(c.pos+1)*kvn : (i+1)*(c.pos+1)*kvn]
			copy(kc[c.pos*kvn:], ki)
			copy(vc[c.pos*kvn:], vn[i*kvn:(i+1)*kvn])
			want = append(want, refAttention(qi, kc, vc, 1, c.pos, c.H, c.KVH, c.hd)...)
			wantK = append(wantK, f64s(kc)...)
		}
		if e := nmse(got, want); !(e < 1e-10) {
			t.Errorf("%s: output NMSE %.3g vs Go reference", c.name, e)
		}
		if e := nmse(k, wantK); !(e < 1e-10) {
			t.Errorf("%s: appended cache NMSE %.3g vs Go reference", c.name, e)
		}
		for i := range v {
			if v[i] != vw[i] {
				t.Fatalf("%s: value cache element %d is %g, want %g", c.name, i, v[i], vw[i])
			}
		}
	}
	if _, err := o.RopeAttention(make([]float32, 16), make([]float32, 8), make([]float32, 8), make([]float32, 8),
		make([]float32, 8), 1, 0, 2, 1, 8, Rope{Theta: 10000}, CUDASettings{}); err != nil {
		t.Fatalf("a valid call: %v", err)
	}
	if _, err := o.RopeAttention(make([]float32, 16), make([]float32, 8), make([]float32, 8), make([]float32, 8),
		make([]float32, 8), 1, 0, 3, 1, 8, Rope{Theta: 10000}, CUDASettings{}); !IsStatus(err, StatusInvalidArgument) {
		t.Fatalf("mismatched shapes: %v, want invalid argument", err)
	}
}

// narrow narrows a float64 reference to float32 (the op inputs' type).
func narrow(x []float64) []float32 {
	out := make([]float32, len(x))
	for i, v := range x {
		out[i] = float32(v)
	}
	return out
}

// The fused decode attention (kernels/attention_fused.cu) against the CPU
// backend, both numerics, output and appended cache; and against the CUDA
// backend's own separate kernels (rope, then attention), bit for bit: the
// fused kernel promises the same sums in the same order.
func TestCUDAFusedAttentionParity(t *testing.T) {
	co := cudaOpsOrSkip(t)
	cpu := CPUOps()
	r := rand.New(rand.NewPCG(opsSeed(t), 6))
	for _, c := range ropeAttentionCases {
		q, kn, vn, k, v := ropeAttentionInputs(r, c)
		kc, vc := append([]float32(nil), k...), append([]float32(nil), v...)
		want, err := cpu.RopeAttention(q, kn, vn, kc, vc, c.n, c.pos, c.H, c.KVH, c.hd, c.rp, CUDASettings{})
		if err != nil {
			t.Fatalf("%s on cpu: %v", c.name, err)
		}
		for _, variant := range []struct {
			op  string
			cs  CUDASettings
			tol float64
		}{
			{"rope-attn", CUDASettings{}, parityTol["attention"]},
			{"rope-attn-f32", CUDASettings{AttentionF32: true}, parityTol["attn-f32"]},
		} {
			kg, vg := append([]float32(nil), k...), append([]float32(nil), v...)
			got, gerr := co.RopeAttention(q, kn, vn, kg, vg, c.n, c.pos, c.H, c.KVH, c.hd, c.rp, variant.cs)
			e, ek := math.Inf(1), math.Inf(1)
			if gerr == nil {
				e, ek = nmse(got, f64s(want)), nmse(kg, f64s(kc))
			}
			status := "ok"
			if !(e < variant.tol && ek < parityTol["rope"]) {
				status = "FAIL"
				t.Errorf("%s %s: output NMSE %.3g (< %g), cache NMSE %.3g (< %g), err %v", variant.op, c.name, e,
					variant.tol, ek, parityTol["rope"], gerr)
			}
			fmt.Printf("PARITY %-13s %-34s nmse %.3e  < %.0e  cache %.1e  %s\n", variant.op, c.name, e, variant.tol, ek, status)
			if gerr != nil {
				continue
			}
			// The separate kernels on the same inputs: rope on q and the new
			// keys, the append by hand, then attention row by row.
			sep, serr := separateRopeAttention(co, q, kn, vn, k, v, c, variant.cs)
			if serr != nil {
				t.Fatalf("%s %s: the separate kernels: %v", variant.op, c.name, serr)
			}
			diff := 0
			for i := range sep {
				if sep[i] != got[i] {
					diff++
				}
			}
			status = "ok"
			if diff != 0 {
				status = "FAIL"
				t.Errorf("%s %s: %d of %d outputs differ from rope + attention's bits", variant.op, c.name, diff, len(sep))
			}
			fmt.Printf("PARITY %-13s %-34s bits vs separate kernels: %d differ  %s\n", variant.op, c.name, diff, status)
		}
	}
}

// separateRopeAttention runs rope_attention's work through the ops the
// unfused backend runs: Rope (rope_append's kernel), then Attention per row.
func separateRopeAttention(o *Ops, q, kn, vn, k, v []float32, c ropeAttentionCase, cs CUDASettings) ([]float32, error) {
	kvn, qn := c.KVH*c.hd, c.H*c.hd
	pos := make([]int32, c.n)
	for i := range pos {
		pos[i] = int32(c.pos)
	}
	qr, kr := append([]float32(nil), q...), append([]float32(nil), kn...)
	if err := o.Rope(qr, c.n, c.H, c.hd, pos, c.rp); err != nil {
		return nil, err
	}
	if err := o.Rope(kr, c.n, c.KVH, c.hd, pos, c.rp); err != nil {
		return nil, err
	}
	out := make([]float32, 0, c.n*qn)
	for i := 0; i < c.n; i++ {
		kc := append([]float32(nil), k[i*(c.pos+1)*kvn:(i+1)*(c.pos+1)*kvn]...)
		vc := append([]float32(nil), v[i*(c.pos+1)*kvn:(i+1)*(c.pos+1)*kvn]...)
		copy(kc[c.pos*kvn:], kr[i*kvn:(i+1)*kvn])
		copy(vc[c.pos*kvn:], vn[i*kvn:(i+1)*kvn])
		o1, err := o.Attention(qr[i*qn:(i+1)*qn], kc, vc, 1, c.pos, c.H, c.KVH, c.hd, cs)
		if err != nil {
			return nil, err
		}
		out = append(out, o1...)
	}
	return out, nil
}

// openCUDAWith opens the CUDA backend under cs, or skips without a GPU host.
func openCUDAWith(t *testing.T, cs CUDASettings) Backend {
	path := os.Getenv("MESHGPU_CUDA_LIB")
	if path == "" {
		t.Skip("MESHGPU_CUDA_LIB is not set: runs on a GPU host (scripts/device-check.sh)")
	}
	b, err := Open("cuda", Options{CUDALib: path, CUDA: cs})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// decodeTrace decodes B sequences (a prompt each, then single tokens: the
// graph path) through Decode and returns each step's picks and logits.
func decodeTrace(t *testing.T, b Backend, cfg StackConfig, tensors []Tensor, prompts [][]int32, n int) ([][]int32, [][]float32) {
	t.Helper()
	st := shardStack(t, b, cfg, tensors)
	defer st.Close()
	ends := st.(Ends)
	steps := make([]TokenStep, len(prompts))
	for i, p := range prompts {
		sess, err := st.NewSession(cfg.MaxContext)
		if err != nil {
			t.Fatal(err)
		}
		defer sess.Close()
		steps[i] = TokenStep{Session: sess, Tokens: p, GeneratedFrom: len(p), Params: endsParams}
	}
	var ids [][]int32
	var logits [][]float32
	for k := 0; k < n; k++ {
		row := make([]int32, len(steps))
		for i := range steps {
			steps[i].Logits = make([]float32, cfg.Vocab)
			steps[i].Draw = k
		}
		got, err := ends.Decode(steps)
		if err != nil {
			t.Fatal(err)
		}
		for i := range steps {
			row[i] = got[i].ID
			logits = append(logits, steps[i].Logits)
			steps[i].Pos += len(steps[i].Tokens)
			steps[i].Tokens = []int32{got[i].ID}
		}
		ids = append(ids, row)
	}
	return ids, logits
}

// fused_decode (the RoPE and the append inside attention, the ends inside
// the decode graph) against the default kernels on the same random model:
// the same picks and the same logits bits, batch 1 and 5, both attention
// numerics, with and without graphs (the fused attention outside a graph).
func TestCUDAFusedDecodeMatchesDefault(t *testing.T) {
	cfg := StackConfig{
		Hidden: 256, Intermediate: 512, Heads: 8, KVHeads: 2, HeadDim: 64, Vocab: 3000,
		NumLayers: 2, First: 0, Last: 1, HasEmbed: true, HasHead: true,
		MaxContext: 600, RMSEps: 1e-5,
		Rope: Rope{Type: RopeLlama3, Theta: 500000, Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OrigMaxPos: 256},
	}
	seed := opsSeed(t)
	tensors := randomTensors(cfg, seed)
	r := rand.New(rand.NewPCG(seed, 7))
	prompt := func(n int) []int32 {
		p := make([]int32, n)
		for i := range p {
			p[i] = int32(r.IntN(cfg.Vocab))
		}
		return p
	}
	// 300 tokens of prompt: past the first graph bucket (256 keys)
	batches := [][][]int32{{prompt(300)}, {prompt(40), prompt(3), prompt(17), prompt(1), prompt(60)}}
	for _, v := range []struct {
		name string
		cs   CUDASettings
	}{
		{"bf16", CUDASettings{}},
		{"f32", CUDASettings{AttentionF32: true}},
		{"bf16 no graphs", CUDASettings{NoGraphs: true}},
	} {
		base := openCUDAWith(t, v.cs)
		fcs := v.cs
		fcs.FusedDecode = true
		fused := openCUDAWith(t, fcs)
		for _, prompts := range batches {
			wantIDs, wantLogits := decodeTrace(t, base, cfg, tensors, prompts, 20)
			gotIDs, gotLogits := decodeTrace(t, fused, cfg, tensors, prompts, 20)
			bad := 0
			for k := range wantLogits {
				if !slices.Equal(gotLogits[k], wantLogits[k]) {
					bad++
				}
			}
			status := "ok"
			if bad != 0 || fmt.Sprint(gotIDs) != fmt.Sprint(wantIDs) {
				status = "FAIL"
				t.Errorf("%s batch %d: %d of %d logits rows differ; ids %v, want %v", v.name, len(prompts), bad,
					len(wantLogits), gotIDs, wantIDs)
			}
			fmt.Printf("STACK fused-decode %-15s batch %d: %d of %d logits rows differ from the default kernels  %s\n",
				v.name, len(prompts), bad, len(wantLogits), status)
		}
	}
}
