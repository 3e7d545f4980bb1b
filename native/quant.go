package native

/*
#include <stdlib.h>
#include "cpu_kernels.h"
#include "cpu_pool.h"

static void q_dequant(int32_t dtype, const void *src, int64_t rows, int32_t cols, size_t row_bytes, float *dst) {
	for (int64_t r = 0; r < rows; r++)
		mg_cpu_dequant_row(dtype, (const char *)src + (size_t)r * row_bytes, cols, dst + (size_t)r * (size_t)cols);
}

// The CPU matrix product on one path (isa, MG_ISA_SCALAR included) with a
// pool of threads (0: the calling thread only).
static int q_matmul(int isa, int threads, const float *x, int32_t dtype, const void *w, int32_t rows, int32_t cols,
		const float *bias, int32_t n, float *out) {
	mg_pool *pool = NULL;
	if (threads > 0 && !(pool = mg_pool_create(threads))) return -1;
	mg_cpu_weight cw = {dtype, w, rows, cols, 0}, cb = {0, bias, rows, 1, 0};
	mg_cpu_matmul_par_isa(pool, isa, x, &cw, bias ? &cb : NULL, n, out);
	mg_pool_free(pool);
	return 0;
}

static int q_has_vnni(void) { return mg_cpu_has_vnni(); }
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// Dequantize returns the rows x cols values of a block-quantized matrix
// (data as stored: ggml's blocks, rows after rows) as the CPU backend
// computes them: ggml's dequantization in f32.
func Dequantize(dt DType, data []byte, rows, cols int) ([]float32, error) {
	if !dt.Quantized() {
		return nil, fmt.Errorf("dequantize: %s is not a quantized type", dt)
	}
	rb, err := dt.RowBytes(cols)
	if err != nil {
		return nil, fmt.Errorf("dequantize: %w", err)
	}
	if rows <= 0 || len(data) != rows*rb {
		return nil, fmt.Errorf("dequantize: %d bytes, want %d rows of %d", len(data), rows, rb)
	}
	out := make([]float32, rows*cols)
	C.q_dequant(C.int32_t(dt), unsafe.Pointer(&data[0]), C.int64_t(rows), C.int32_t(cols), C.size_t(rb), f32p(out))
	return out, nil
}

// cpuMatmulPath runs the CPU backend's matrix product out [n, w.Rows] =
// x @ w^T (+ bias, f32, may be nil) on one path by index (cpuISAs; 0, the
// scalar reference, runs on any build for quantized weights) with a pool
// of threads (0: the calling thread). For tests.
func cpuMatmulPath(isa, threads int, x []float32, w OpsWeight, bias []float32, n int) ([]float32, error) {
	if err := w.check("matmul"); err != nil {
		return nil, err
	}
	if n <= 0 || len(x) != n*w.Cols || (bias != nil && len(bias) != w.Rows) {
		return nil, fmt.Errorf("matmul: %d inputs for %d rows of %d, %d biases", len(x), n, w.Cols, len(bias))
	}
	out := make([]float32, n*w.Rows)
	if C.q_matmul(C.int(isa), C.int(threads), f32p(x), C.int32_t(w.DType), bytep(w.Data), C.int32_t(w.Rows), C.int32_t(w.Cols),
		f32p(bias), C.int32_t(n), f32p(out)) != 0 {
		return nil, fmt.Errorf("matmul: no thread pool")
	}
	return out, nil
}

// promptPath, or'd into cpuMatmulPath's isa, runs a prompt's products
// (cpu_kernels.h MG_PATH_PROMPT).
const promptPath = C.MG_PATH_PROMPT

// setQ16VNNI chooses whether the AVX-512 16-bit quantized kernels use
// VNNI where the CPU has it (the default, true); false runs their plain
// AVX-512BW form, as on a CPU without VNNI. For tests.
func setQ16VNNI(on bool) {
	v := 0
	if on {
		v = 1
	}
	C.mg_cpu_q16_set_vnni(C.int(v))
}

// hasVNNI says whether the CPU has AVX512_VNNI (and AVX-512 is usable).
func hasVNNI() bool { return C.q_has_vnni() != 0 }

// setPromptQ16 forces the prompt kernel for quantized weights on AVX-512:
// 1 the 16-bit VNNI kernel, 0 the f32 tile, -1 back to the start-up
// measurement's choice (CPUPromptQ16Speedup). For tests.
func setPromptQ16(mode int) { C.mg_cpu_set_prompt_q16(C.int(mode)) }

// CPUPromptQ16 says whether quantized weights' prompt rows take the
// 16-bit VNNI kernel now, and CPUPromptQ16Speedup how many times faster it
// ran than the f32 tile at start-up (0 where it is not supported).
func CPUPromptQ16() bool           { return C.mg_cpu_prompt_q16() != 0 }
func CPUPromptQ16Speedup() float64 { return float64(C.mg_cpu_prompt_q16_speedup()) }

// CPUHasVNNI says whether the CPU backend's AVX-512 paths may use AVX-512 VNNI.
func CPUHasVNNI() bool { return C.mg_cpu_has_vnni() != 0 }
