package native

/*
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include "meshgpu_ops.h"

// Trampolines for the op test table (meshgpu_ops.h). Weights arrive as
// flat fields so no Go memory holding a Go pointer is passed to C; each
// trampoline copies the thread-local error in the same C call.
static void ops_copy_err(const mg_ops_api *a, char *err, size_t n) {
	const char *m = a->last_error ? a->last_error() : NULL;
	if (!m || !*m) m = "(no message)";
	strncpy(err, m, n - 1);
	err[n - 1] = 0;
}
#define OPS_RET(call) do { mg_status st_ = (call); if (st_ != MG_OK) ops_copy_err(a, err, errlen); return st_; } while (0)
#define OPS_W(name) mg_ops_weight name = {name##_dt, name##_p, name##_r, name##_c}
#define OPS_WARGS(name) int32_t name##_dt, const void *name##_p, int32_t name##_r, int32_t name##_c

static const mg_ops_api *ops_cuda(const char *path, char *err, size_t errlen) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		const char *m = dlerror();
		strncpy(err, m ? m : "dlopen failed", errlen - 1);
		err[errlen - 1] = 0;
		return NULL;
	}
	mg_get_ops_fn f = (mg_get_ops_fn)dlsym(h, MG_CUDA_OPS_ENTRY);
	if (!f) {
		strncpy(err, "library does not export " MG_CUDA_OPS_ENTRY, errlen - 1);
		err[errlen - 1] = 0;
		return NULL;
	}
	const mg_ops_api *a = f(MG_OPS_ABI_VERSION);
	if (!a) strncpy(err, "mg_cuda_ops returned NULL (ABI mismatch or no GPU)", errlen - 1);
	// The handle stays open: the table points into the library.
	return a;
}
static mg_status o_embed(const mg_ops_api *a, OPS_WARGS(t), const int32_t *tok, int32_t n, float *out, char *err, size_t errlen) {
	OPS_W(t); OPS_RET(a->embed(&t, tok, n, out));
}
static mg_status o_rmsnorm(const mg_ops_api *a, const float *x, OPS_WARGS(w), float eps, int32_t n, float *out, char *err, size_t errlen) {
	OPS_W(w); OPS_RET(a->rmsnorm(x, &w, eps, n, out));
}
static mg_status o_matmul(const mg_ops_api *a, const float *x, OPS_WARGS(w), int has_bias, OPS_WARGS(b),
		const float *res, int32_t n, float *out, char *err, size_t errlen) {
	OPS_W(w); OPS_W(b); OPS_RET(a->matmul(x, &w, has_bias ? &b : NULL, res, n, out));
}
static mg_status o_swiglu(const mg_ops_api *a, const float *x, OPS_WARGS(g), OPS_WARGS(u), int32_t n, float *out, char *err, size_t errlen) {
	OPS_W(g); OPS_W(u); OPS_RET(a->swiglu(x, &g, &u, n, out));
}
static mg_status o_rope(const mg_ops_api *a, float *x, int32_t n, int32_t heads, const int32_t *pos, int32_t type,
		float theta, float factor, float lo, float hi, int32_t orig, int32_t hd, char *err, size_t errlen) {
	mg_ops_rope p = {type, theta, factor, lo, hi, orig, hd};
	OPS_RET(a->rope(x, n, heads, pos, &p));
}
static mg_status o_attention_tree(const mg_ops_api *a, const float *q, const float *k, const float *v, int32_t n, int32_t pos0,
		const int32_t *parents, int32_t h, int32_t kvh, int32_t hd, float *out, char *err, size_t errlen) {
	OPS_RET(a->attention_tree(q, k, v, n, pos0, parents, h, kvh, hd, out));
}
static mg_status o_attention(const mg_ops_api *a, const float *q, const float *k, const float *v, int32_t n, int32_t pos0,
		int32_t h, int32_t kvh, int32_t hd, int32_t attn, int32_t prefill, float *out, char *err, size_t errlen) {
	OPS_RET(a->attention(q, k, v, n, pos0, h, kvh, hd, attn, prefill, out));
}
static mg_status o_rope_attention(const mg_ops_api *a, const float *q, const float *kn, const float *vn, float *k, float *v,
		int32_t n, int32_t pos, int32_t h, int32_t kvh, int32_t type, float theta, float factor, float lo, float hi,
		int32_t orig, int32_t hd, int32_t attn, float *out, char *err, size_t errlen) {
	mg_ops_rope p = {type, theta, factor, lo, hi, orig, hd};
	OPS_RET(a->rope_attention(q, kn, vn, k, v, n, pos, h, kvh, &p, attn, out));
}
static mg_status o_logits(const mg_ops_api *a, const float *x, OPS_WARGS(nw), OPS_WARGS(hw), float eps, int32_t n, float *out,
		char *err, size_t errlen) {
	OPS_W(nw); OPS_W(hw); OPS_RET(a->logits(x, &nw, &hw, eps, n, out));
}
static mg_status o_copy_gbps(const mg_ops_api *a, uint64_t bytes, int32_t iters, double *out, char *err, size_t errlen) {
	OPS_RET(a->copy_gbps(bytes, iters, out));
}
static mg_status o_gemm_tflops(const mg_ops_api *a, int32_t m, int32_t n, int32_t k, int32_t iters, double *out, char *err, size_t errlen) {
	OPS_RET(a->gemm_tflops(m, n, k, iters, out));
}
static mg_status o_matvec_gbps(const mg_ops_api *a, int32_t m, int32_t k, int32_t n, int32_t iters, double *out, char *err, size_t errlen) {
	OPS_RET(a->matvec_gbps(m, k, n, iters, out));
}
*/
import "C"

import (
	"fmt"
	"sync"
	"unsafe"
)

// Ops is a backend's op-level test table (meshgpu_ops.h): each kernel family
// callable on host slices, so the CUDA kernels can be compared one by one
// with the CPU backend's reference kernels. Activations are f32; weights are
// passed as stored. Not for inference: Stack is.
type Ops struct {
	api  *C.mg_ops_api
	Name string
}

// OpsWeight is a weight as stored: Rows x Cols row-major (Cols = 1 for vectors).
type OpsWeight struct {
	DType      DType
	Data       []byte
	Rows, Cols int
}

const opsErrLen = 512

// CPUOps is the CPU backend's table.
func CPUOps() *Ops { return &Ops{api: C.mg_cpu_ops(), Name: "cpu"} }

var cudaOps sync.Map // path -> *Ops

// LoadCUDAOps dlopens libmeshgpu_cuda.so at path and returns its table.
func LoadCUDAOps(path string) (*Ops, error) {
	if o, ok := cudaOps.Load(path); ok {
		return o.(*Ops), nil
	}
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var eb [opsErrLen]C.char
	api := C.ops_cuda(cpath, &eb[0], opsErrLen)
	if api == nil {
		return nil, fmt.Errorf("cuda ops: %s: %s", path, C.GoString(&eb[0]))
	}
	o := &Ops{api: api, Name: C.GoString(api.name)}
	cudaOps.Store(path, o)
	return o, nil
}

func opsErr(op string, st C.mg_status, eb *[opsErrLen]C.char) error {
	if st == C.MG_OK {
		return nil
	}
	return &Error{Status: Status(st), Op: op, Msg: C.GoString(&eb[0])}
}

// check: Rows x Cols of DType (block-quantized: Rows whole rows of blocks).
func (w OpsWeight) check(op string) error {
	rb, err := w.DType.RowBytes(w.Cols)
	if err != nil || w.Rows <= 0 || len(w.Data) != w.Rows*rb {
		return &Error{Status: StatusInvalidArgument, Op: op,
			Msg: fmt.Sprintf("weight %dx%d %s has %d bytes", w.Rows, w.Cols, w.DType, len(w.Data))}
	}
	return nil
}

func argErr(op, format string, a ...any) error {
	return &Error{Status: StatusInvalidArgument, Op: op, Msg: fmt.Sprintf(format, a...)}
}

func f32p(s []float32) *C.float {
	if len(s) == 0 {
		return nil
	}
	return (*C.float)(unsafe.Pointer(&s[0]))
}

func bytep(b []byte) unsafe.Pointer { return unsafe.Pointer(&b[0]) }

// Embed returns len(tokens) rows of table.Cols values.
func (o *Ops) Embed(table OpsWeight, tokens []int32) ([]float32, error) {
	if err := table.check("embed"); err != nil {
		return nil, err
	}
	if len(tokens) == 0 {
		return nil, argErr("embed", "no tokens")
	}
	out := make([]float32, len(tokens)*table.Cols)
	var eb [opsErrLen]C.char
	st := C.o_embed(o.api, C.int32_t(table.DType), bytep(table.Data), C.int32_t(table.Rows), C.int32_t(table.Cols),
		(*C.int32_t)(unsafe.Pointer(&tokens[0])), C.int32_t(len(tokens)), f32p(out), &eb[0], opsErrLen)
	return out, opsErr("embed", st, &eb)
}

// RMSNorm normalizes n rows of w.Rows values.
func (o *Ops) RMSNorm(x []float32, w OpsWeight, eps float32, n int) ([]float32, error) {
	if err := w.check("rmsnorm"); err != nil {
		return nil, err
	}
	if n <= 0 || len(x) != n*w.Rows {
		return nil, argErr("rmsnorm", "x has %d values, want %d rows of %d", len(x), n, w.Rows)
	}
	out := make([]float32, len(x))
	var eb [opsErrLen]C.char
	st := C.o_rmsnorm(o.api, f32p(x), C.int32_t(w.DType), bytep(w.Data), C.int32_t(w.Rows), C.int32_t(w.Cols),
		C.float(eps), C.int32_t(n), f32p(out), &eb[0], opsErrLen)
	return out, opsErr("rmsnorm", st, &eb)
}

// Matmul returns x [n, w.Cols] @ w^T (+ bias) (+ residual [n, w.Rows]).
func (o *Ops) Matmul(x []float32, w OpsWeight, bias *OpsWeight, residual []float32, n int) ([]float32, error) {
	if err := w.check("matmul"); err != nil {
		return nil, err
	}
	if n <= 0 || len(x) != n*w.Cols {
		return nil, argErr("matmul", "x has %d values, want %d rows of %d", len(x), n, w.Cols)
	}
	if residual != nil && len(residual) != n*w.Rows {
		return nil, argErr("matmul", "residual has %d values, want %d", len(residual), n*w.Rows)
	}
	b := OpsWeight{DType: w.DType, Data: w.Data, Rows: 1, Cols: 1}
	hasBias := C.int(0)
	if bias != nil {
		if err := bias.check("matmul"); err != nil {
			return nil, err
		}
		b, hasBias = *bias, 1
	}
	out := make([]float32, n*w.Rows)
	var eb [opsErrLen]C.char
	st := C.o_matmul(o.api, f32p(x), C.int32_t(w.DType), bytep(w.Data), C.int32_t(w.Rows), C.int32_t(w.Cols),
		hasBias, C.int32_t(b.DType), bytep(b.Data), C.int32_t(b.Rows), C.int32_t(b.Cols),
		f32p(residual), C.int32_t(n), f32p(out), &eb[0], opsErrLen)
	return out, opsErr("matmul", st, &eb)
}

// SwiGLU returns silu(x @ gate^T) * (x @ up^T), [n, gate.Rows].
func (o *Ops) SwiGLU(x []float32, gate, up OpsWeight, n int) ([]float32, error) {
	if err := gate.check("swiglu"); err != nil {
		return nil, err
	}
	if err := up.check("swiglu"); err != nil {
		return nil, err
	}
	if n <= 0 || len(x) != n*gate.Cols {
		return nil, argErr("swiglu", "x has %d values, want %d rows of %d", len(x), n, gate.Cols)
	}
	out := make([]float32, n*gate.Rows)
	var eb [opsErrLen]C.char
	st := C.o_swiglu(o.api, f32p(x),
		C.int32_t(gate.DType), bytep(gate.Data), C.int32_t(gate.Rows), C.int32_t(gate.Cols),
		C.int32_t(up.DType), bytep(up.Data), C.int32_t(up.Rows), C.int32_t(up.Cols),
		C.int32_t(n), f32p(out), &eb[0], opsErrLen)
	return out, opsErr("swiglu", st, &eb)
}

// Rope rotates x [n, heads, headDim] in place; token t at positions[t].
func (o *Ops) Rope(x []float32, n, heads, headDim int, positions []int32, r Rope) error {
	if n <= 0 || heads <= 0 || headDim <= 0 || len(x) != n*heads*headDim || len(positions) != n {
		return argErr("rope", "x has %d values and %d positions for %d x %d x %d", len(x), len(positions), n, heads, headDim)
	}
	var eb [opsErrLen]C.char
	st := C.o_rope(o.api, f32p(x), C.int32_t(n), C.int32_t(heads), (*C.int32_t)(unsafe.Pointer(&positions[0])),
		C.int32_t(r.Type), C.float(r.Theta), C.float(r.Factor), C.float(r.LowFreqFactor), C.float(r.HighFreqFactor),
		C.int32_t(r.OrigMaxPos), C.int32_t(headDim), &eb[0], opsErrLen)
	return opsErr("rope", st, &eb)
}

// Attention: q [n, heads, hd]; k, v [pos0+n, kvHeads, hd]; query i attends
// keys 0..pos0+i. Returns [n, heads*hd]. The CUDA side runs the kernel its
// backend would run for one step of n tokens under cs (its numerics and
// prefill kernel); the CPU reference is f32 math whatever cs says.
func (o *Ops) Attention(q, k, v []float32, n, pos0, heads, kvHeads, hd int, cs CUDASettings) ([]float32, error) {
	if n <= 0 || pos0 < 0 || heads <= 0 || kvHeads <= 0 || hd <= 0 || len(q) != n*heads*hd ||
		len(k) != (pos0+n)*kvHeads*hd || len(v) != len(k) {
		return nil, argErr("attention", "shapes: q %d, k %d, v %d for n %d pos0 %d heads %d/%d hd %d",
			len(q), len(k), len(v), n, pos0, heads, kvHeads, hd)
	}
	out := make([]float32, n*heads*hd)
	var eb [opsErrLen]C.char
	bo, _ := optionsOf(Options{CUDA: cs}) // device and threads are 0: no error
	st := C.o_attention(o.api, f32p(q), f32p(k), f32p(v), C.int32_t(n), C.int32_t(pos0), C.int32_t(heads),
		C.int32_t(kvHeads), C.int32_t(hd), C.int32_t(bo.attention), C.int32_t(bo.prefillAttention), f32p(out), &eb[0], opsErrLen)
	return out, opsErr("attention", st, &eb)
}

// RopeAttention decodes n single-token sequences at position pos with the
// RoPE and the KV append inside attention (on CUDA the fused kernel that
// CUDASettings.FusedDecode runs): q [n, heads, hd] and kn, vn [n,
// kvHeads, hd] before RoPE; k, v [n, pos+1, kvHeads, hd] the caches, whose
// entry pos it overwrites with rope(kn) and vn. Returns [n, heads*hd].
func (o *Ops) RopeAttention(q, kn, vn, k, v []float32, n, pos, heads, kvHeads, hd int, r Rope, cs CUDASettings) ([]float32, error) {
	if n <= 0 || pos < 0 || heads <= 0 || kvHeads <= 0 || hd <= 0 || len(q) != n*heads*hd || len(kn) != n*kvHeads*hd ||
		len(vn) != len(kn) || len(k) != n*(pos+1)*kvHeads*hd || len(v) != len(k) {
		return nil, argErr("rope_attention", "shapes: q %d, kn %d, vn %d, k %d, v %d for n %d pos %d heads %d/%d hd %d",
			len(q), len(kn), len(vn), len(k), len(v), n, pos, heads, kvHeads, hd)
	}
	out := make([]float32, n*heads*hd)
	var eb [opsErrLen]C.char
	bo, _ := optionsOf(Options{CUDA: cs})
	st := C.o_rope_attention(o.api, f32p(q), f32p(kn), f32p(vn), f32p(k), f32p(v), C.int32_t(n), C.int32_t(pos),
		C.int32_t(heads), C.int32_t(kvHeads), C.int32_t(r.Type), C.float(r.Theta), C.float(r.Factor),
		C.float(r.LowFreqFactor), C.float(r.HighFreqFactor), C.int32_t(r.OrigMaxPos), C.int32_t(hd),
		C.int32_t(bo.attention), f32p(out), &eb[0], opsErrLen)
	return out, opsErr("rope_attention", st, &eb)
}

// AttentionTree is Attention over a token tree: query i attends keys
// 0..pos0-1 and this call's keys j that are i or its ancestors (parents[i]
// in -1..i-1, meshgpu.h mg_tree_step). The CUDA side runs the tree kernel
// (f32 softmax).
func (o *Ops) AttentionTree(q, k, v []float32, n, pos0 int, parents []int32, heads, kvHeads, hd int) ([]float32, error) {
	if n <= 0 || n > MaxTreeRows || pos0 < 0 || heads <= 0 || kvHeads <= 0 || hd <= 0 || len(q) != n*heads*hd ||
		len(k) != (pos0+n)*kvHeads*hd || len(v) != len(k) || len(parents) != n {
		return nil, argErr("attention_tree", "shapes: q %d, k %d, v %d, %d parents for n %d pos0 %d heads %d/%d hd %d",
			len(q), len(k), len(v), len(parents), n, pos0, heads, kvHeads, hd)
	}
	out := make([]float32, n*heads*hd)
	var eb [opsErrLen]C.char
	st := C.o_attention_tree(o.api, f32p(q), f32p(k), f32p(v), C.int32_t(n), C.int32_t(pos0), (*C.int32_t)(&parents[0]),
		C.int32_t(heads), C.int32_t(kvHeads), C.int32_t(hd), f32p(out), &eb[0], opsErrLen)
	return out, opsErr("attention_tree", st, &eb)
}

// Logits applies the final norm and LM head: [n, head.Rows] f32.
func (o *Ops) Logits(x []float32, norm, head OpsWeight, eps float32, n int) ([]float32, error) {
	if err := norm.check("logits"); err != nil {
		return nil, err
	}
	if err := head.check("logits"); err != nil {
		return nil, err
	}
	if n <= 0 || len(x) != n*head.Cols {
		return nil, argErr("logits", "x has %d values, want %d rows of %d", len(x), n, head.Cols)
	}
	out := make([]float32, n*head.Rows)
	var eb [opsErrLen]C.char
	st := C.o_logits(o.api, f32p(x), C.int32_t(norm.DType), bytep(norm.Data), C.int32_t(norm.Rows), C.int32_t(norm.Cols),
		C.int32_t(head.DType), bytep(head.Data), C.int32_t(head.Rows), C.int32_t(head.Cols),
		C.float(eps), C.int32_t(n), f32p(out), &eb[0], opsErrLen)
	return out, opsErr("logits", st, &eb)
}

// CopyGBps measures device-to-device copy bandwidth (read + write bytes).
func (o *Ops) CopyGBps(bytes uint64, iters int) (float64, error) {
	var v C.double
	var eb [opsErrLen]C.char
	st := C.o_copy_gbps(o.api, C.uint64_t(bytes), C.int32_t(iters), &v, &eb[0], opsErrLen)
	return float64(v), opsErr("copy_gbps", st, &eb)
}

// GemmTFLOPS measures the cuBLAS bf16 rate for [n,k] x [m,k]^T.
func (o *Ops) GemmTFLOPS(m, n, k, iters int) (float64, error) {
	var v C.double
	var eb [opsErrLen]C.char
	st := C.o_gemm_tflops(o.api, C.int32_t(m), C.int32_t(n), C.int32_t(k), C.int32_t(iters), &v, &eb[0], opsErrLen)
	return float64(v), opsErr("gemm_tflops", st, &eb)
}

// MatvecGBps measures the decode matrix-vector kernel's weight bandwidth.
func (o *Ops) MatvecGBps(m, k, n, iters int) (float64, error) {
	var v C.double
	var eb [opsErrLen]C.char
	st := C.o_matvec_gbps(o.api, C.int32_t(m), C.int32_t(k), C.int32_t(n), C.int32_t(iters), &v, &eb[0], opsErrLen)
	return float64(v), opsErr("matvec_gbps", st, &eb)
}
