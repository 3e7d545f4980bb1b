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

// TestCUDAMatmulMMAParity: the tensor-core matrix-vector kernel
// (matvec_mma.cu, CUDASettings.BatchMMA) against the CPU reference at
// batch 1, 2, 3, 8, 16 (17: cuBLAS), on layer widths of both shapes and
// each weight dtype; and a batched row equals the same row alone, bit for
// bit (sessions decoded together must not change each other's results).
func TestCUDAMatmulMMAParity(t *testing.T) {
	co := cudaOpsOrSkip(t)
	cpu := CPUOps()
	r := rand.New(rand.NewPCG(opsSeed(t), 41))
	for _, c := range []struct{ m, k int }{{256, 2048}, {200, 4096}, {96, 14336}, {64, 72}} {
		for _, dt := range []DType{BF16, F16, F32} {
			w, _ := randWeight(r, dt, c.m, c.k, 0.02)
			for _, n := range []int{1, 2, 3, 8, 16, 17} {
				x := randActs(r, n*c.k, 1)
				got, err := co.MatmulMMA(x, w, n)
				if err != nil {
					t.Fatal(err)
				}
				ref, err := cpu.MatmulMMA(x, w, n)
				if err != nil {
					t.Fatal(err)
				}
				e := nmse(got, f64s(ref))
				same := true
				if n > 1 && n <= 16 {
					last := n - 1
					one, err := co.MatmulMMA(x[last*c.k:], w, 1)
					if err != nil {
						t.Fatal(err)
					}
					same = slices.Equal(one, got[last*c.m:])
				}
				status := "ok"
				if e > parityTol["matmul"] || !same {
					status = "FAIL"
					t.Errorf("m %d k %d %s n %d: nmse %.3e, batched row = alone: %v", c.m, c.k, dt, n, e, same)
				}
				fmt.Printf("PARITY %-9s %-34s nmse %.3e  < %.0e  %s\n", "mma", fmt.Sprintf("%dx%d %s, %d rows, row=alone %v", c.m, c.k, dt, n, same), e, parityTol["matmul"], status)
			}
		}
	}
}

// BenchmarkCUDAMatvecMMA: the tensor-core kernel's weight bandwidth as a
// share of the copy bandwidth, next to the FMA kernel's on the same shapes
// (the batch-8 target: close to batch 1's share).
func BenchmarkCUDAMatvecMMA(b *testing.B) {
	co := cudaOpsOrSkip(b)
	copyGBps, err := co.CopyGBps(2<<30, 20)
	if err != nil {
		b.Fatal(err)
	}
	for _, s := range []struct {
		name    string
		m, k, n int
	}{
		{"8B-gateup-b1", 28672, 4096, 1}, {"8B-gateup-b8", 28672, 4096, 8}, {"8B-gateup-b16", 28672, 4096, 16},
		{"8B-down-b8", 4096, 14336, 8}, {"8B-down-b16", 4096, 14336, 16}, {"8B-qkv-b8", 6144, 4096, 8},
	} {
		b.Run(s.name, func(b *testing.B) {
			var mma, fma float64
			for i := 0; i < b.N; i++ {
				if mma, err = co.MMAGBps(s.m, s.k, s.n, 50); err != nil {
					b.Fatal(err)
				}
				if fma, err = co.MatvecGBps(s.m, s.k, s.n, 50); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(mma/copyGBps, "mma-of-copy")
			b.ReportMetric(fma/copyGBps, "fma-of-copy")
		})
	}
}
