package native

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/model/gguf"
)

var quantTypes = []DType{Q8_0, Q4_K, Q5_K, Q6_K}

// blockScale is the largest |scale| of a block as ggml defines it (d for
// Q8_0 and Q6_K, max(d, dmin) for Q4_K/Q5_K, times the largest 6-bit or
// int8 sub-scale), the unit of the dequantization tolerance.
func blockScales(dt DType, block []byte) float64 {
	d := float64(fromF16(binary.LittleEndian.Uint16(block)))
	switch dt {
	case Q8_0:
		return math.Abs(d)
	case Q4_K, Q5_K:
		dmin := float64(fromF16(binary.LittleEndian.Uint16(block[2:])))
		return math.Max(math.Abs(d), math.Abs(dmin)) * 63
	case Q6_K:
		d = float64(fromF16(binary.LittleEndian.Uint16(block[208:])))
		return math.Abs(d) * 128
	}
	return 0
}

// TestDequantizeMatchesLlamaCpp: every tensor of gocoder-6m-gguf/dequantized
// (llama.cpp's gguf-py dequantization of tensors of each quantized file),
// read from the GGUF with model/gguf as stored (GGUF row order) and
// dequantized by the CPU backend's C code: within 1e-6 of each block's
// scale of llama.cpp's values, and in fact the same bytes (sha256 of
// index.json).
func TestDequantizeMatchesLlamaCpp(t *testing.T) {
	dir := testenv.Shared(t, "models/gocoder-6m-gguf/dequantized")
	idx, err := os.ReadFile(filepath.Join(dir, "index.json"))
	if err != nil {
		t.Fatal(err)
	}
	var index map[string]struct {
		File, Tensor, Type string
		Shape              []int
		SHA256             string
	}
	if err := json.Unmarshal(idx, &index); err != nil {
		t.Fatal(err)
	}
	if len(index) == 0 {
		t.Fatal("index.json lists no tensors")
	}
	seen := map[DType]bool{}
	names := make([]string, 0, len(index))
	for k := range index {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, name := range names {
		e := index[name]
		f, err := gguf.Open(filepath.Join(filepath.Dir(dir), e.File))
		if err != nil {
			t.Fatal(err)
		}
		info, ok := f.Tensor(e.Tensor)
		if !ok {
			f.Close()
			t.Fatalf("%s: no tensor %s", e.File, e.Tensor)
		}
		dt := DType(info.Type)
		if !dt.Quantized() || !strings.EqualFold(dt.String(), e.Type) {
			f.Close()
			t.Fatalf("%s: type %s, index.json says %s", name, info.Type, e.Type)
		}
		seen[dt] = true
		shape := info.Shape()
		if !slices.Equal(shape, e.Shape) {
			t.Errorf("%s: shape %v, index.json says %v", name, shape, e.Shape)
		}
		data, _ := f.Data(info)
		got, err := Dequantize(dt, data, shape[0], shape[1])
		if err != nil {
			f.Close()
			t.Fatal(err)
		}
		raw, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			f.Close()
			t.Fatal(err)
		}
		if len(raw) != 4*len(got) {
			f.Close()
			t.Fatalf("%s: %d bytes, want %d", name, len(raw), 4*len(got))
		}
		be, bb := dt.Block()
		bad := 0
		for i, g := range got {
			want := math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
			blk := i / be
			tol := 1e-6 * blockScales(dt, data[blk*bb:(blk+1)*bb])
			if d := math.Abs(float64(g) - float64(want)); !(d <= tol) {
				if bad < 5 {
					t.Errorf("%s: element %d (row %d, col %d): %g, llama.cpp %g (tolerance %g)", name, i, i/shape[1], i%shape[1], g, want, tol)
				}
				bad++
			}
		}
		mine := make([]byte, len(raw))
		for i, g := range got {
			binary.LittleEndian.PutUint32(mine[4*i:], math.Float32bits(g))
		}
		sum := sha256.Sum256(mine)
		if h := hex.EncodeToString(sum[:]); h != e.SHA256 {
			t.Errorf("%s: sha256 %s, index.json %s (%d of %d values outside the tolerance)", name, h, e.SHA256, bad, len(got))
		}
		f.Close()
	}
	for _, dt := range quantTypes {
		if !seen[dt] {
			t.Errorf("no %s tensor in dequantized/", dt)
		}
	}
}

// randQuant returns rows x cols of random blocks of dt: random q bytes and
// scale bytes (every bit pattern), f16 scales around scale/64.
func randQuant(r *rand.Rand, dt DType, rows, cols int, scale float64) OpsWeight {
	rb, err := dt.RowBytes(cols)
	if err != nil {
		panic(err)
	}
	be, bb := dt.Block()
	data := make([]byte, rows*rb)
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	f16 := func() uint16 { return toF16(float32(scale * (0.5 + r.Float64()) / 64)) }
	for b := 0; b < rows*cols/be; b++ {
		blk := data[b*bb : (b+1)*bb]
		switch dt {
		case Q8_0:
			binary.LittleEndian.PutUint16(blk, toF16(float32(scale*(0.5+r.Float64())/128)))
		case Q4_K, Q5_K:
			binary.LittleEndian.PutUint16(blk, f16())
			binary.LittleEndian.PutUint16(blk[2:], f16())
		case Q6_K:
			binary.LittleEndian.PutUint16(blk[208:], toF16(float32(scale*(0.5+r.Float64())/4096)))
		}
	}
	return OpsWeight{DType: dt, Data: data, Rows: rows, Cols: cols}
}

// quantPaths are the paths the quantized products run on here: the scalar
// reference (index 0, on any build) and every path CPUISAs lists.
func quantPaths() []int {
	paths := []int{0}
	for i, name := range cpuISAs {
		if i > 0 && slices.Contains(CPUISAs(), name) {
			paths = append(paths, i)
		}
	}
	return paths
}

// TestQuantMatmulEveryPath: each quantized type's matrix product with each
// activation width (16 bits, cpu_quant.c; 8 bits, cpu_quant8.c) on every
// path (the scalar reference and each SIMD path, AVX2 forced included; on
// a CPU with VNNI the 16-bit AVX-512 paths also without it), 1, 2, 3, 5,
// 7, 8, 9, 17 and 512 rows of random f32 activations (several tokens widen
// the rows, AVX2 widening on the AVX2 path; AVX-512 takes them 8 a pass,
// two per register, an odd last one paired with zeros), odd block counts
// and column counts that end mid-pass, one thread and a pool of two:
//   - NMSE against a float64 product over the dequantized weights (which
//     TestDequantizeMatchesLlamaCpp ties to llama.cpp) below quantActNMSE:
//     16 bits per 32 give 2e-10 to 2e-9 on gaussian inputs, 8 bits per 32
//     (Q8_0) or per 256 (K-quants) 2e-5 to 1.1e-4;
//   - the same bits as the scalar reference (the order is fixed);
//   - each token's row the same bits as a one-token call (batch-invariant).
func TestQuantMatmulEveryPath(t *testing.T) {
	seed := opsSeed(t)
	defer SetCPUQuantAct(0)
	defer setQ16VNNI(true)
	for _, act := range []int{16, 8} {
		if err := SetCPUQuantAct(act); err != nil {
			t.Fatal(err)
		}
		r := rand.New(rand.NewPCG(seed, 24))
		worst := map[DType]float64{}
		for _, dt := range quantTypes {
			be, _ := dt.Block()
			for _, c := range []struct{ rows, cols, n int }{
				{67, be, 1}, {67, 3 * be, 8}, {40, 2048, 1}, {130, 2048, 8}, {33, 768, 512}, {512, 2048, 1},
				{21, 2 * be, 2}, {17, be, 3}, {29, 4 * be, 4}, // small decode batches: token by token (qtoken_max), or batched
				{19, 3 * be, 5}, {35, 2 * be, 7}, // batched: 4 tokens at a time and the rest; AVX-512: pairs and an odd token
				{23, 5 * be, 9}, {37, 7 * be, 17}, // AVX-512: 8 a pass and the rest (one token paired with zeros); odd blocks
			} {
				what := fmt.Sprintf("%d-bit activations, %s %dx%d n=%d", act, dt, c.rows, c.cols, c.n)
				w := randQuant(r, dt, c.rows, c.cols, 1/math.Sqrt(float64(c.cols)))
				wv, err := Dequantize(dt, w.Data, c.rows, c.cols)
				if err != nil {
					t.Fatal(err)
				}
				bias := randF32(r, c.rows, 0.5)
				x := randF32(r, c.n*c.cols, 1)
				want := refMatmul(f64s(x), wv, bias, c.rows, c.cols, c.n)
				ref, err := cpuMatmulPath(0, 0, x, w, bias, c.n)
				if err != nil {
					t.Fatal(err)
				}
				for _, path := range quantVNNIPaths(act) {
					isa := path.isa
					setQ16VNNI(path.vnni)
					for _, threads := range []int{0, 2} {
						got, err := cpuMatmulPath(isa, threads, x, w, bias, c.n)
						if err != nil {
							t.Fatal(err)
						}
						name := fmt.Sprintf("%s on %s%s, %d threads", what, cpuISAs[isa], path.note, threads)
						e := nmse(got, want)
						worst[dt] = max(worst[dt], e)
						if !(e < quantActNMSE[act]) {
							t.Errorf("%s: NMSE %.3g vs float64 over the dequantized weights, want < %.0e", name, e, quantActNMSE[act])
						}
						if !slices.Equal(got, ref) {
							t.Errorf("%s: differs from the scalar reference", name)
						}
						if threads != 0 {
							continue
						}
						for _, tok := range []int{0, c.n / 2, c.n - 1} {
							one, err := cpuMatmulPath(isa, 0, x[tok*c.cols:(tok+1)*c.cols], w, bias, 1)
							if err != nil {
								t.Fatal(err)
							}
							if !slices.Equal(one, got[tok*c.rows:(tok+1)*c.rows]) {
								t.Errorf("%s: token %d alone differs from the batch", name, tok)
								break
							}
						}
					}
				}
			}
		}
		t.Logf("%d-bit activations: worst NMSE %v", act, worst)
	}
}

// TestQuantPromptProducts: on AVX-512, a prompt's rows (MG_PATH_PROMPT)
// multiply quantized weights as f32 products on the dequantized rows, and
// bf16 weights on avx512f on their widened rows (cpu_matmul_avx512.c):
// within f32 rounding of a float64 product over the dequantized weights
// (the 16-bit decode products are 1e2-1e3 times further off: the test
// fails if the prompt rows take them), the same bits for any number of
// tokens and threads. Where the CPU has VNNI the 16-bit prompt kernel
// (cpu_matmul_q16prompt.c) runs too: within decode's rounding of the
// float64 product, within f32 rounding of decode's 16-bit products, not the
// f32 tile's bits, and again the same bits for any tokens and threads.
func TestQuantPromptProducts(t *testing.T) {
	var paths []int
	for i, name := range cpuISAs {
		if strings.HasPrefix(name, "avx512") && slices.Contains(CPUISAs(), name) {
			paths = append(paths, i)
		}
	}
	if len(paths) == 0 {
		t.Skip("no AVX-512 path on this CPU: prompts take decode's products")
	}
	r := rand.New(rand.NewPCG(opsSeed(t), 26))
	t.Cleanup(func() { setPromptQ16(-1) })
	for _, dt := range append([]DType{BF16}, quantTypes...) {
		be := 32
		if dt != BF16 {
			be, _ = dt.Block()
		}
		for _, c := range []struct{ rows, cols, n int }{{67, be, 1}, {130, 2048, 33}, {37, 7 * be, 17}, {9, 3 * be, 64}} {
			var w OpsWeight
			var wv []float32
			if dt == BF16 {
				w, wv = randWeight(r, BF16, c.rows, c.cols, 1/math.Sqrt(float64(c.cols)))
			} else {
				w = randQuant(r, dt, c.rows, c.cols, 1/math.Sqrt(float64(c.cols)))
				var err error
				if wv, err = Dequantize(dt, w.Data, c.rows, c.cols); err != nil {
					t.Fatal(err)
				}
			}
			bias := randF32(r, c.rows, 0.5)
			x := randF32(r, c.n*c.cols, 1)
			want := refMatmul(f64s(x), wv, bias, c.rows, c.cols, c.n)
			for _, k := range promptKernels(dt) {
				for _, isa := range paths {
					if dt == BF16 && cpuISAs[isa] != "avx512f" {
						continue // avx512bf16 keeps its bf16 products for bf16 weights
					}
					setPromptQ16(k.q16)
					what := fmt.Sprintf("%s %dx%d n=%d on %s, %s", dt, c.rows, c.cols, c.n, cpuISAs[isa], k.name)
					got, err := cpuMatmulPath(isa|promptPath, 0, x, w, bias, c.n)
					if err != nil {
						t.Fatal(err)
					}
					if e := nmse(got, want); !(e < k.nmse) {
						t.Errorf("%s: NMSE %.3g vs float64 over the dequantized weights, want < %.0g", what, e, k.nmse)
					}
					if k.q16 == 1 {
						// the 16-bit kernel is not the f32 tile, and not decode's order
						f32, dec := prompt16Others(t, isa, x, w, bias, c.n)
						if slices.Equal(got, f32) {
							t.Errorf("%s: the f32 tile's bits: the 16-bit kernel did not run", what)
						}
						if e := nmse(got, f64s(dec)); !(e < 1e-12) {
							t.Errorf("%s: NMSE %.3g vs decode's 16-bit products, want < 1e-12 (the same rounding)", what, e)
						}
					}
					two, err := cpuMatmulPath(isa|promptPath, 2, x, w, bias, c.n)
					if err != nil {
						t.Fatal(err)
					}
					if !slices.Equal(two, got) {
						t.Errorf("%s: 2 threads differ from 1", what)
					}
					for _, tok := range []int{0, c.n - 1} {
						one, err := cpuMatmulPath(isa|promptPath, 0, x[tok*c.cols:(tok+1)*c.cols], w, bias, 1)
						if err != nil {
							t.Fatal(err)
						}
						if !slices.Equal(one, got[tok*c.rows:(tok+1)*c.rows]) {
							t.Errorf("%s: token %d alone differs from the batch", what, tok)
						}
					}
				}
			}
		}
	}
}

type promptKernel struct {
	name string
	q16  int     // setPromptQ16
	nmse float64 // against float64 over the dequantized weights
}

// promptKernels: bf16 weights have the f32 tile only; quantized ones the
// f32 tile (f32 products: NMSE < 1e-12) and, where the CPU has VNNI, the
// 16-bit kernel (activations rounded to 16 bits, as decode's: < 1e-8).
func promptKernels(dt DType) []promptKernel {
	ks := []promptKernel{{"f32 tile", 0, 1e-12}}
	if dt != BF16 && CPUHasVNNI() {
		ks = append(ks, promptKernel{"16-bit VNNI", 1, 1e-8})
	}
	return ks
}

// prompt16Others: the same product on the f32 prompt tile and on decode's
// 16-bit products; leaves the 16-bit prompt kernel chosen.
func prompt16Others(t *testing.T, isa int, x []float32, w OpsWeight, bias []float32, n int) (f32, dec []float32) {
	t.Helper()
	defer setPromptQ16(1)
	setPromptQ16(0)
	f32, err := cpuMatmulPath(isa|promptPath, 0, x, w, bias, n)
	if err != nil {
		t.Fatal(err)
	}
	if dec, err = cpuMatmulPath(isa, 0, x, w, bias, n); err != nil {
		t.Fatal(err)
	}
	return f32, dec
}

type quantPath struct {
	isa  int
	vnni bool   // setQ16VNNI
	note string // in the test's names
}

// quantVNNIPaths are quantPaths, each AVX-512 path twice for 16-bit
// activations on a CPU with VNNI: with it and without.
func quantVNNIPaths(act int) []quantPath {
	var ps []quantPath
	for _, isa := range quantPaths() {
		ps = append(ps, quantPath{isa, true, ""})
		if act == 16 && hasVNNI() && strings.HasPrefix(cpuISAs[isa], "avx512") {
			ps = append(ps, quantPath{isa, false, " without VNNI"})
		}
	}
	return ps
}

// quantActNMSE bounds the products' error by activation width, about 5x
// the worst measured (TestQuantMatmulEveryPath logs it).
var quantActNMSE = map[int]float64{16: 1e-8, 8: 5e-4}

// The op table's matmul and embed take quantized weights on the CPU (the
// path in use): matmul as cpuMatmulPath, embed as Dequantize's rows.
func TestOpsQuantized(t *testing.T) {
	r := rand.New(rand.NewPCG(opsSeed(t), 25))
	o := CPUOps()
	for _, dt := range quantTypes {
		w := randQuant(r, dt, 48, 512, 0.05)
		wv, _ := Dequantize(dt, w.Data, w.Rows, w.Cols)
		x := randF32(r, 3*512, 1)
		got, err := o.Matmul(x, w, nil, nil, 3)
		if err != nil {
			t.Fatal(err)
		}
		if e := nmse(got, refMatmul(f64s(x), wv, nil, 48, 512, 3)); !(e < quantActNMSE[CPUQuantAct()]) {
			t.Errorf("%s matmul: NMSE %.3g", dt, e)
		}
		rows, err := o.Embed(w, []int32{5, 0, 47})
		if err != nil {
			t.Fatal(err)
		}
		for i, tok := range []int{5, 0, 47} {
			if !slices.Equal(rows[i*512:(i+1)*512], wv[tok*512:(tok+1)*512]) {
				t.Errorf("%s embed: row %d is not the dequantized row", dt, tok)
			}
		}
		bad := w
		bad.Data = w.Data[:len(w.Data)-1]
		if _, err := o.Matmul(x, bad, nil, nil, 3); err == nil {
			t.Errorf("%s: a short weight was accepted", dt)
		}
	}
}

// quantConfig is a stack whose matrices are all whole K-quant blocks.
func quantConfig() StackConfig {
	return StackConfig{
		Hidden: 256, Intermediate: 512, Heads: 4, KVHeads: 2, HeadDim: 64, Vocab: 40,
		NumLayers: 2, First: 0, Last: 1, HasEmbed: true, HasHead: true,
		MaxContext: 32, RMSEps: 1e-5, Rope: Rope{Type: RopeDefault, Theta: 10000},
	}
}

// quantTensors is randomTensors with every matrix quantized to dt, and the
// same tensors with those matrices as their exact f32 values.
func quantTensors(t *testing.T, cfg StackConfig, dt DType, seed uint64) (q, f []Tensor) {
	r := rand.New(rand.NewPCG(seed, 9))
	for _, ts := range randomTensors(cfg, seed) {
		if len(ts.Shape) == 1 {
			q, f = append(q, ts), append(f, ts)
			continue
		}
		w := randQuant(r, dt, ts.Shape[0], ts.Shape[1], 1/math.Sqrt(float64(ts.Shape[1])))
		if ts.Kind == TokEmbed {
			w = randQuant(r, dt, ts.Shape[0], ts.Shape[1], 1)
		}
		vals, err := Dequantize(dt, w.Data, w.Rows, w.Cols)
		if err != nil {
			t.Fatal(err)
		}
		fd := make([]byte, 4*len(vals))
		for i, v := range vals {
			binary.LittleEndian.PutUint32(fd[4*i:], math.Float32bits(v))
		}
		qt := ts
		qt.DType, qt.Data = dt, w.Data
		ft := ts
		ft.DType, ft.Data = F32, fd
		q, f = append(q, qt), append(f, ft)
	}
	return q, f
}

// TestQuantizedStack: a stack of quantized matrices (embedding and LM head
// included) computes what the same stack computes on the dequantized
// values as f32 weights (the quantized products round activations: NMSE <
// 1e-7 with 16 bits, < 5e-4 with 8, measured up to 5.8e-5 on q6_k),
// and prefill equals token-by-token decode bit for bit.
func TestQuantizedStack(t *testing.T) {
	cfg := quantConfig()
	b := openCPU(t, 2)
	for _, dt := range quantTypes {
		qs, fs := quantTensors(t, cfg, dt, 11)
		stq, err := b.NewStack(cfg)
		if err != nil {
			t.Fatal(err)
		}
		stf, err := b.NewStack(cfg)
		if err != nil {
			t.Fatal(err)
		}
		for i := range qs {
			if err := stq.SetTensor(qs[i]); err != nil {
				t.Fatalf("%s: %v", dt, err)
			}
			if err := stf.SetTensor(fs[i]); err != nil {
				t.Fatal(err)
			}
		}
		if err := stq.Ready(); err != nil {
			t.Fatal(err)
		}
		if err := stf.Ready(); err != nil {
			t.Fatal(err)
		}
		tokens := []int32{1, 7, 39, 0, 12, 5}
		logits := func(st Stack, step bool) []float32 {
			sess, err := st.NewSession(16)
			if err != nil {
				t.Fatal(err)
			}
			defer sess.Close()
			var act []byte
			if step {
				for i := range tokens {
					act = run(t, st, sess, i, tokens[i:i+1], F32)
				}
			} else {
				act = run(t, st, sess, 0, tokens, F32)
				act = act[(len(tokens)-1)*cfg.Hidden*4:]
			}
			out := make([]float32, cfg.Vocab)
			if err := st.Logits(1, F32, act, out); err != nil {
				t.Fatal(err)
			}
			return out
		}
		got, ref := logits(stq, false), logits(stf, false)
		if e := nmse(got, f64s(ref)); !(e < map[int]float64{16: 1e-7, 8: 5e-4}[CPUQuantAct()]) {
			t.Errorf("%s: logits NMSE %.3g against the dequantized f32 stack", dt, e)
		}
		if stepped := logits(stq, true); !slices.Equal(stepped, got) {
			t.Errorf("%s: token-by-token decode differs from prefill", dt)
		}
		stq.Close()
		stf.Close()
	}
}

// TestQuantizedBadInput: one clear error each for a quantized tensor whose
// bytes do not match its shape, whose rows are not whole blocks, that is a
// norm, or whose type is unknown.
func TestQuantizedBadInput(t *testing.T) {
	b := openCPU(t, 1)
	cfg := quantConfig()
	st, err := b.NewStack(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	r := rand.New(rand.NewPCG(1, 2))
	w := randQuant(r, Q4_K, 512, 256, 0.1)
	good := Tensor{Kind: WGate, Layer: 0, DType: Q4_K, Shape: []int{512, 256}, Data: w.Data}
	if err := st.SetTensor(good); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		what string
		t    Tensor
		want string
	}{
		{"a block short", Tensor{Kind: WGate, Layer: 0, DType: Q4_K, Shape: []int{512, 256}, Data: w.Data[:len(w.Data)-144]}, "want 73728"},
		{"a block too many", Tensor{Kind: WGate, Layer: 0, DType: Q4_K, Shape: []int{512, 256}, Data: append(slices.Clone(w.Data), w.Data[:144]...)}, "want 73728"},
		{"bytes of another type", Tensor{Kind: WGate, Layer: 0, DType: Q6_K, Shape: []int{512, 256}, Data: w.Data}, "want 107520"},
		{"rows not whole blocks", Tensor{Kind: WGate, Layer: 0, DType: Q4_K, Shape: []int{1024, 128}, Data: w.Data}, "not a whole number of 256-element blocks"},
		{"a quantized norm", Tensor{Kind: AttnNorm, Layer: 0, DType: Q8_0, Shape: []int{256}, Data: w.Data[:272]}, "must be a matrix"},
		{"unknown type", Tensor{Kind: WGate, Layer: 0, DType: DType(2 + 8), Shape: []int{512, 256}, Data: w.Data}, "unknown dtype 10"},
	}
	for _, c := range cases {
		err := st.SetTensor(c.t)
		wantStatus(t, c.what, err, StatusInvalidArgument)
		if err != nil && (!strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "\n")) {
			t.Errorf("%s: error %q, want one line with %q", c.what, err, c.want)
		}
	}
}

// BenchmarkQuantMatmul: one thread, the default path, [8192, 2048] and
// [2048, 8192] weights (the 1B shape's gate and down projections) of each
// quantized type (with 16-bit and 8-bit activations) and bf16, at 1, 8 and
// 128 tokens: GB/s of weights for one token, GFLOP/s for several, and the
// process's CPU time per call (cpu_ms/op: what to compare on a shared machine).
func BenchmarkQuantMatmul(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 2))
	defer SetCPUQuantAct(0)
	for _, shape := range [][2]int{{8192, 2048}, {2048, 8192}} {
		rows, cols := shape[0], shape[1]
		for _, dt := range append([]DType{BF16}, quantTypes...) {
			var w OpsWeight
			acts := []int{8}
			if dt == BF16 {
				w, _ = randWeight(r, BF16, rows, cols, 0.02)
			} else {
				w = randQuant(r, dt, rows, cols, 0.02)
				acts = []int{16, 8}
			}
			for _, n := range []int{1, 8, 128} {
				x := randF32(r, n*cols, 1)
				for _, act := range acts {
					name := fmt.Sprintf("%dx%d/%s/n=%d", rows, cols, dt, n)
					if dt != BF16 {
						name = fmt.Sprintf("%dx%d/%s/act%d/n=%d", rows, cols, dt, act, n)
					}
					b.Run(name, func(b *testing.B) {
						if err := SetCPUQuantAct(act); err != nil {
							b.Fatal(err)
						}
						cpu0 := cpuSeconds()
						for i := 0; i < b.N; i++ {
							if _, err := cpuMatmulPath(slices.Index(cpuISAs, CPUISA()), 0, x, w, nil, n); err != nil {
								b.Fatal(err)
							}
						}
						b.ReportMetric((cpuSeconds()-cpu0)*1e3/float64(b.N), "cpu_ms/op")
						s := b.Elapsed().Seconds() / float64(b.N)
						if n == 1 {
							b.ReportMetric(float64(len(w.Data))/s/1e9, "GB/s")
						} else {
							b.ReportMetric(2*float64(rows)*float64(cols)*float64(n)/s/1e9, "GFLOP/s")
						}
					})
				}
			}
		}
	}
}

// cpuSeconds is the process's user and system CPU time.
func cpuSeconds() float64 {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}

// TestCPUQuantActDefault: unless set, the activations' width is 16 bits
// on every path (cpu_isa.c: 8 bits widen honest replicas' spread past what
// audits tolerate), a set width holds on every path, 0 restores the
// default, and the backend's description names the width that runs.
func TestCPUQuantActDefault(t *testing.T) {
	t.Cleanup(func() { SetCPUISA(""); SetCPUQuantAct(0) })
	for _, isa := range CPUISAs() {
		if err := SetCPUISA(isa); err != nil {
			t.Fatal(err)
		}
		const want = 16
		for _, set := range []int{0, 16, 8, 0} {
			if err := SetCPUQuantAct(set); err != nil {
				t.Fatal(err)
			}
			w := set
			if set == 0 {
				w = want
			}
			if got := CPUQuantAct(); got != w {
				t.Errorf("%s, SetCPUQuantAct(%d): CPUQuantAct() = %d, want %d", isa, set, got, w)
			}
			b, err := Open("cpu", Options{})
			if err != nil {
				t.Fatal(err)
			}
			if d := b.Describe(); !strings.Contains(d, fmt.Sprintf("%d-bit activations", w)) {
				t.Errorf("%s, width %d: the backend describes itself as %q", isa, w, d)
			}
			b.Close()
		}
	}
	if err := SetCPUQuantAct(12); err == nil {
		t.Error("SetCPUQuantAct(12) accepted")
	}
}

// TestCPUQuantKernels: the backend's description names the kernels its
// quantized products take, and they follow the path: AVX2's under a forced
// avx2 (--cpu-isa avx2), the AVX-512 ones (VNNI where the CPU has it)
// under avx512f and avx512bf16, for 16-bit activations (the default).
func TestCPUQuantKernels(t *testing.T) {
	t.Cleanup(func() { SetCPUISA(""); setQ16VNNI(true) })
	for _, isa := range CPUISAs() {
		for _, vnni := range []bool{true, false} {
			want := "avx2"
			switch {
			case isa == "scalar":
				want = "scalar"
			case strings.HasPrefix(isa, "avx512") && vnni && hasVNNI():
				want = "avx512vnni"
			case strings.HasPrefix(isa, "avx512"):
				want = "avx512bw"
			}
			if err := SetCPUISA(isa); err != nil {
				t.Fatal(err)
			}
			setQ16VNNI(vnni)
			b, err := Open("cpu", Options{})
			if err != nil {
				t.Fatal(err)
			}
			if d := b.Describe(); !strings.Contains(d, "16-bit activations for quantized weights on "+want+" kernels") {
				t.Errorf("%s (VNNI allowed: %v): the backend describes itself as %q, want %s kernels", isa, vnni, d, want)
			}
			b.Close()
		}
	}
}
