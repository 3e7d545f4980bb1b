package native

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// normWeight is an RMSNorm weight near 1, as trained ones are.
func normWeight(r *rand.Rand, dim int) OpsWeight {
	w, _ := randWeight(r, BF16, dim, 1, 0.1)
	for i := 0; i < dim; i++ {
		h := toBF16(1 + fromBF16(uint16(w.Data[2*i])|uint16(w.Data[2*i+1])<<8))
		w.Data[2*i], w.Data[2*i+1] = byte(h), byte(h>>8)
	}
	return w
}

// TestOpsCPUNormMatmul: the CPU entry is rmsnorm then matmul, exactly.
func TestOpsCPUNormMatmul(t *testing.T) {
	cpu := CPUOps()
	r := rand.New(rand.NewPCG(4, 4))
	const k, m = 64, 24
	for _, n := range []int{1, 3, 17} {
		x := randActs(r, n*k, 1)
		nw := normWeight(r, k)
		w, _ := randWeight(r, BF16, m, k, 0.1)
		got, err := cpu.NormMatmul(x, nw, 1e-5, w, n)
		if err != nil {
			t.Fatal(err)
		}
		h, err := cpu.RMSNorm(x, nw, 1e-5, n)
		if err != nil {
			t.Fatal(err)
		}
		want, err := cpu.Matmul(h, w, nil, nil, n)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("n %d: norm_matmul differs from rmsnorm + matmul", n)
		}
	}
	if _, err := cpu.NormMatmul(make([]float32, 8), normWeight(r, 4), 1e-5, OpsWeight{DType: BF16, Data: make([]byte, 2*8*2), Rows: 2, Cols: 8}, 1); err == nil {
		t.Error("a norm of the wrong width was accepted")
	}
}

// TestCUDANormMatmulParity: the RMSNorm folded into the matrix-vector
// kernel (kernels/matvec.cu gemv_norm) gives the same bits as the CUDA
// rmsnorm op followed by the CUDA matmul op (the unfused path), and stays
// within the matmul bound of the CPU reference, at batch 1, 2, 3, 8, 16
// (and 17: rmsnorm + cuBLAS), on the 1B and 8B hidden sizes.
func TestCUDANormMatmulParity(t *testing.T) {
	co := cudaOpsOrSkip(t)
	cpu := CPUOps()
	r := rand.New(rand.NewPCG(opsSeed(t), 31))
	for _, k := range []int{2048, 4096, 200} {
		m := 256
		nw := normWeight(r, k)
		w, _ := randWeight(r, BF16, m, k, 0.02)
		for _, n := range []int{1, 2, 3, 8, 16, 17} {
			x := randActs(r, n*k, 1)
			got, err := co.NormMatmul(x, nw, 1e-5, w, n)
			if err != nil {
				t.Fatal(err)
			}
			h, err := co.RMSNorm(x, nw, 1e-5, n)
			if err != nil {
				t.Fatal(err)
			}
			unfused, err := co.Matmul(h, w, nil, nil, n)
			if err != nil {
				t.Fatal(err)
			}
			ref, err := cpu.NormMatmul(x, nw, 1e-5, w, n)
			if err != nil {
				t.Fatal(err)
			}
			e := nmse(got, f64s(ref))
			same := n > 16 || slices.Equal(got, unfused)
			status := "ok"
			if e > parityTol["matmul"] || !same {
				status = "FAIL"
				t.Errorf("k %d n %d: nmse %.3e, bit-equal to rmsnorm + matmul: %v", k, n, e, same)
			}
			fmt.Printf("PARITY %-9s %-34s nmse %.3e  < %.0e  %s\n", "normmm", fmt.Sprintf("k %d, %d rows, = unfused %v", k, n, same), e, parityTol["matmul"], status)
		}
	}
}
