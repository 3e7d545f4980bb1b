package native

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
)

// The CUDA kernels for block-quantized weights (kernels/quant.cu) against
// the CPU backend on the same blocks. They run where MESHGPU_CUDA_LIB names
// libmeshgpu_cuda.so (scripts/device-check.sh, step quant) and skip
// elsewhere.

// q8Rounded is what the CUDA decode path multiplies the weights with:
// each group of 32 activations (bf16 values, as the op's device copy holds
// them) rounded to int8 as quantize_rows does, d = max|x| / 127 in f32 and
// q = round(x / d) half away from zero (roundf), returned as d * q.
func q8Rounded(x []float32) []float64 {
	out := make([]float64, len(x))
	for g := 0; g+32 <= len(x); g += 32 {
		var amax float32
		for _, v := range x[g : g+32] {
			amax = max(amax, float32(math.Abs(float64(v))))
		}
		d := amax / 127
		for i, v := range x[g : g+32] {
			if amax != 0 {
				out[g+i] = float64(d) * math.Round(float64(v/d))
			}
		}
	}
	return out
}

// Thresholds of the quantized rows (NMSE):
//   - "qmatmul" (CUDA against the CPU's product over the same blocks, which
//     TestQuantMatmulEveryPath holds within 1e-8 of exact math): on 1-16
//     rows the activations are rounded to int8 per 32, an error uniform in
//     ±d/2 with d = max|x|/127, about 2.4σ/127 for 32 gaussian values, so
//     the products' NMSE is (d²/12)/σ² ≈ 3e-5; 1e-4 leaves room for the
//     bf16 output and catches any wrong scale, min, nibble or block (1e-3
//     and up: one sub-block's scale wrong in 8 is already ~1e-2). On 17+
//     rows (dequantized bf16 weights, cuBLAS) two bf16 roundings remain:
//     about 3e-6, bound 1e-5 as the float matmul rows;
//   - "qmatmul-i8" (1-16 rows, against a float64 product of the
//     dequantized weights with q8Rounded activations: the same function
//     the kernel computes): only f32 accumulation and the bf16 output
//     remain, bound 1e-5.
var quantParityTol = map[string]float64{"qmatmul": 1e-4, "qmatmul-prefill": 1e-5, "qmatmul-i8": 1e-5}

func quantParityRow(t *testing.T, failed *int, op, what string, got []float32, err error, want []float64) {
	t.Helper()
	tol := quantParityTol[op]
	e := math.Inf(1)
	if err == nil {
		e = nmse(got, want)
	}
	status := "ok"
	if !(e < tol) {
		status = "FAIL"
		*failed++
	}
	fmt.Printf("PARITY %-15s %-36s nmse %.3e  < %.0e  %s\n", op, what, e, tol, status)
	if err != nil {
		t.Errorf("%s %s on cuda: %v", op, what, err)
	} else if status != "ok" {
		t.Errorf("%s %s: NMSE %.3g, want < %g", op, what, e, tol)
	}
}

// TestCUDAQuantMatmulParity: each quantized type's matrix product on CUDA
// (qgemv for 1, 4 and 16 rows, the dequantize + cuBLAS path for 17 and 512,
// bias and residual epilogues, k = 2048 and 4096 as Llama's) against the
// CPU backend on the same blocks, and the decode rows against the exact
// function they compute; the first row of a batch equals that row alone,
// bit for bit (batch invariance, as the bf16 kernels).
func TestCUDAQuantMatmulParity(t *testing.T) {
	co := cudaOpsOrSkip(t)
	cpu := CPUOps()
	r := rand.New(rand.NewPCG(opsSeed(t), 24))
	failed := 0
	type mm struct {
		n, m, k   int
		bias, res bool
	}
	for _, dt := range quantTypes {
		var alone []float32 // row 0 of the first case, n = 1
		var x0 []float32
		var w0 OpsWeight
		for ci, c := range []mm{
			{1, 1024, 2048, false, false}, {4, 1024, 2048, false, false}, {16, 768, 4096, false, false},
			{2, 512, 2048, true, false}, {3, 512, 4096, false, true}, {17, 256, 2048, false, false},
			{512, 512, 1024, true, false},
		} {
			w := randQuant(r, dt, c.m, c.k, 1/math.Sqrt(float64(c.k)))
			x := randActs(r, c.n*c.k, 1)
			if ci == 1 { // the n = 4 case's first row is the n = 1 case's row
				w = w0
				copy(x, x0)
			}
			var b *OpsWeight
			var bv []float32
			if c.bias {
				var bw OpsWeight
				bw, bv = randWeight(r, BF16, c.m, 1, 0.5)
				b = &bw
			}
			var res []float32
			if c.res {
				res = randActs(r, c.n*c.m, 1)
			}
			what := fmt.Sprintf("%s n%d %dx%d", dt, c.n, c.m, c.k)
			if c.bias {
				what += " +bias"
			}
			if c.res {
				what += " +residual"
			}
			g, ge := co.Matmul(x, w, b, res, c.n)
			cc, ce := cpu.Matmul(x, w, b, res, c.n)
			if ce != nil {
				t.Fatalf("%s on cpu: %v", what, ce)
			}
			if c.n > 16 {
				quantParityRow(t, &failed, "qmatmul-prefill", what, g, ge, f64s(cc))
				continue
			}
			quantParityRow(t, &failed, "qmatmul", what, g, ge, f64s(cc))
			wv, err := Dequantize(dt, w.Data, c.m, c.k)
			if err != nil {
				t.Fatal(err)
			}
			want := refMatmul(q8Rounded(x), wv, bv, c.m, c.k, c.n)
			for i := range want {
				if res != nil {
					want[i] += float64(res[i])
				}
			}
			quantParityRow(t, &failed, "qmatmul-i8", what, g, ge, want)
			switch ci {
			case 0:
				alone, x0, w0 = g, x, w
			case 1:
				if ge == nil && !slices.Equal(g[:c.m], alone) {
					failed++
					t.Errorf("%s: row 0 of a batch of 4 differs from the same row alone", dt)
				}
			}
		}
	}
	fmt.Printf("PARITY qmatmul summary: %d failed\n", failed)
}

// TestCUDAQuantEmbed: the embedding gather of a quantized table gives the
// CPU's dequantized rows (ggml's f32 arithmetic, TestDequantizeMatchesLlamaCpp)
// rounded to bf16, bit for bit.
func TestCUDAQuantEmbed(t *testing.T) {
	co := cudaOpsOrSkip(t)
	r := rand.New(rand.NewPCG(opsSeed(t), 26))
	for _, dt := range quantTypes {
		w := randQuant(r, dt, 300, 512, 1)
		toks := []int32{0, 299, 17, 17, 150}
		got, err := co.Embed(w, toks)
		if err != nil {
			t.Fatalf("%s: %v", dt, err)
		}
		vals, err := Dequantize(dt, w.Data, w.Rows, w.Cols)
		if err != nil {
			t.Fatal(err)
		}
		bad := 0
		for i, tk := range toks {
			for j := 0; j < 512; j++ {
				if got[i*512+j] != fromBF16(toBF16(vals[int(tk)*512+j])) {
					bad++
				}
			}
		}
		fmt.Printf("PARITY qembed %s: %d of %d values differ from bf16(cpu dequantized)\n", dt, bad, len(got))
		if bad != 0 {
			t.Errorf("%s: %d embedding values differ from the CPU's dequantized rows rounded to bf16", dt, bad)
		}
	}
}

// quantStackConfig is quantConfig with room for a 40-token prefill (the
// CUDA backend's dequantize + cuBLAS path) and the decode steps after it.
func quantStackConfig() StackConfig {
	cfg := quantConfig()
	cfg.MaxContext = 64
	return cfg
}

// TestCUDAQuantStackMatchesCPU: a stack of each quantized type (embedding
// and LM head included) on CUDA and on the CPU: logits after a 6-token
// prefill (decode kernels), a 40-token prefill (dequantize + cuBLAS) and
// three single-token steps (the decode graph) within 5e-2 relative L2. The
// CUDA residual stream is bf16 and its decode activations int8 per 32
// (the CPU's: f32, 16 bits): each product is ~0.5% off, over two layers'
// seven products and the head; the float stack test's bound is 3e-2.
func TestCUDAQuantStackMatchesCPU(t *testing.T) {
	path := os.Getenv("MESHGPU_CUDA_LIB")
	if path == "" {
		t.Skip("MESHGPU_CUDA_LIB is not set: the CUDA quantized stack runs on a GPU host (scripts/device-check.sh)")
	}
	cb, err := Open("cuda", Options{CUDALib: path})
	if err != nil {
		t.Fatal(err)
	}
	defer cb.Close()
	pb := openCPU(t, 0)
	cfg := quantStackConfig()
	const tol = 5e-2
	for _, dt := range quantTypes {
		qs, _ := quantTensors(t, cfg, dt, opsSeed(t))
		stacks := make([]Stack, 2)
		for i, b := range []Backend{cb, pb} {
			st, err := b.NewStack(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer st.Close()
			for _, ts := range qs {
				if err := st.SetTensor(ts); err != nil {
					t.Fatalf("%s on %s: %v", dt, b.Name(), err)
				}
			}
			if err := st.Ready(); err != nil {
				t.Fatalf("%s on %s: %v", dt, b.Name(), err)
			}
			stacks[i] = st
		}
		r := rand.New(rand.NewPCG(uint64(dt), 5))
		tokens := make([]int32, 43)
		for i := range tokens {
			tokens[i] = int32(r.IntN(cfg.Vocab))
		}
		for _, c := range []struct {
			what    string
			prefill int
		}{{"prefill 6 (qgemv)", 6}, {"prefill 40 (dequantize + cublas) + 3 decode steps", 40}} {
			var logits [2][][]float32
			for i, st := range stacks {
				sess, err := st.NewSession(cfg.MaxContext)
				if err != nil {
					t.Fatal(err)
				}
				act := run(t, st, sess, 0, tokens[:c.prefill], F32)
				rows := [][]byte{act[(c.prefill-1)*cfg.Hidden*4:]}
				if c.prefill == 40 {
					for p := 40; p < 43; p++ {
						rows = append(rows, run(t, st, sess, p, tokens[p:p+1], F32))
					}
				}
				for _, row := range rows {
					out := make([]float32, cfg.Vocab)
					if err := st.Logits(1, F32, row, out); err != nil {
						t.Fatal(err)
					}
					logits[i] = append(logits[i], out)
				}
				sess.Close()
			}
			for j := range logits[0] {
				e := relErr(logits[0][j], logits[1][j])
				status := "ok"
				if !(e < tol) {
					status = "FAIL"
					t.Errorf("%s %s row %d: logits rel L2 %.3g vs cpu, want < %g", dt, c.what, j, e, tol)
				}
				fmt.Printf("STACK quant %s %s row %d: rel L2 %.3e < %.0e %s\n", dt, c.what, j, e, tol, status)
			}
		}
	}
}

// TestCUDAQuantLoadErrors: what a file can get wrong reaches the CUDA
// backend as one clear error at load: blocks that do not match the shape,
// rows that are not whole blocks (both refused before the backend, by the
// binding, for every backend), and a layer mixing quantized and float
// matrices (the CUDA backend fuses q/k/v and gate/up one way or the other:
// stack_ready refuses it).
func TestCUDAQuantLoadErrors(t *testing.T) {
	path := os.Getenv("MESHGPU_CUDA_LIB")
	if path == "" {
		t.Skip("MESHGPU_CUDA_LIB is not set: runs on a GPU host (scripts/device-check.sh)")
	}
	cb, err := Open("cuda", Options{CUDALib: path})
	if err != nil {
		t.Fatal(err)
	}
	defer cb.Close()
	cfg := quantStackConfig()
	st, err := cb.NewStack(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	r := rand.New(rand.NewPCG(3, 4))
	w := randQuant(r, Q4_K, cfg.Intermediate, cfg.Hidden, 0.1)
	short := Tensor{Kind: WGate, Layer: 0, DType: Q4_K, Shape: []int{cfg.Intermediate, cfg.Hidden}, Data: w.Data[:len(w.Data)-144]}
	if err := st.SetTensor(short); !IsStatus(err, StatusInvalidArgument) {
		t.Errorf("a Q4_K matrix a block short: %v, want invalid argument", err)
	}
	partial := Tensor{Kind: WGate, Layer: 0, DType: Q8_0, Shape: []int{cfg.Intermediate, 200}, Data: make([]byte, cfg.Intermediate*7*34)}
	if err := st.SetTensor(partial); !IsStatus(err, StatusInvalidArgument) {
		t.Errorf("Q8_0 rows of 200 elements: %v, want invalid argument", err)
	}
	for _, ts := range randomTensors(cfg, 7) {
		if err := st.SetTensor(ts); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.SetTensor(Tensor{Kind: WGate, Layer: 1, DType: Q4_K, Shape: []int{cfg.Intermediate, cfg.Hidden}, Data: w.Data}); err != nil {
		t.Fatal(err)
	}
	err = st.Ready()
	if !IsStatus(err, StatusUnsupported) || !strings.Contains(err.Error(), "layer 1 has 1 quantized and 6 float") {
		t.Errorf("a layer with one Q4_K matrix among float ones: %v, want unsupported naming the layer", err)
	}
}
