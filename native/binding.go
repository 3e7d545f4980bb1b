package native

/*
#cgo CFLAGS: -O3 -std=c11 -Wall
// -std=c11 (not gnu11) also means -ffp-contract=off: a*b+c is never fused
// behind our back, so every kernel's arithmetic is exactly as written.
#cgo amd64 CFLAGS: -march=x86-64-v3
#cgo LDFLAGS: -lm -lpthread -ldl
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include "meshgpu.h"

// Trampolines: Go cannot call C function pointers. Each copies the
// thread-local last error in the same C call, because the goroutine may move
// to another OS thread before the next one.
static void mg_copy_err(const mg_api *a, char *err, size_t n) {
	const char *m = a->last_error ? a->last_error() : NULL;
	if (!m || !*m) m = "(no message)";
	strncpy(err, m, n - 1);
	err[n - 1] = 0;
}
#define MG_RET(call) do { mg_status st_ = (call); if (st_ != MG_OK) mg_copy_err(a, err, errlen); return st_; } while (0)

static mg_status t_backend_open(const mg_api *a, const mg_backend_options *o, mg_backend **out, char *err, size_t errlen) {
	MG_RET(a->backend_open(o, out));
}
static void t_backend_close(const mg_api *a, mg_backend *b) { a->backend_close(b); }
static mg_status t_backend_memory(const mg_api *a, mg_backend *b, uint64_t *fr, uint64_t *tot, char *err, size_t errlen) {
	MG_RET(a->backend_memory(b, fr, tot));
}
static const char *t_backend_describe(const mg_api *a, mg_backend *b) { return a->backend_describe(b); }
static mg_status t_host_alloc(const mg_api *a, mg_backend *b, size_t n, void **out, char *err, size_t errlen) {
	MG_RET(a->host_alloc(b, n, out));
}
static void t_host_free(const mg_api *a, mg_backend *b, void *p) { a->host_free(b, p); }
static mg_status t_stack_create(const mg_api *a, mg_backend *b, const mg_stack_config *cfg, mg_stack **out, char *err, size_t errlen) {
	MG_RET(a->stack_create(b, cfg, out));
}
static mg_status t_stack_set_tensor(const mg_api *a, mg_stack *s, int32_t kind, int32_t layer, int32_t dtype,
		const int64_t *shape, int32_t ndim, const void *data, size_t nbytes, char *err, size_t errlen) {
	MG_RET(a->stack_set_tensor(s, kind, layer, dtype, shape, ndim, data, nbytes));
}
static mg_status t_stack_ready(const mg_api *a, mg_stack *s, char *err, size_t errlen) { MG_RET(a->stack_ready(s)); }
static void t_stack_free(const mg_api *a, mg_stack *s) { a->stack_free(s); }
static mg_status t_session_create(const mg_api *a, mg_stack *s, int32_t max_tokens, mg_session **out, char *err, size_t errlen) {
	MG_RET(a->session_create(s, max_tokens, out));
}
static void t_session_free(const mg_api *a, mg_session *se) { a->session_free(se); }
static int32_t t_session_len(const mg_api *a, mg_session *se) { return a->session_len(se); }
static mg_status t_embed(const mg_api *a, mg_stack *s, const int32_t *tokens, int32_t n, int32_t dtype, void *out, char *err, size_t errlen) {
	MG_RET(a->embed(s, tokens, n, dtype, out));
}
static mg_status t_forward(const mg_api *a, mg_stack *s, const mg_step *steps, int32_t n_steps, int32_t first, int32_t last,
		int32_t dtype, const void *in, void *out, char *err, size_t errlen) {
	MG_RET(a->forward(s, steps, n_steps, first, last, dtype, in, out));
}
// tree_has reports whether the table has the token-tree calls appended to
// ABI 5 (forward_tree, session_compact).
static int tree_has(const mg_api *a) {
	return a->table_size >= offsetof(mg_api, session_compact) + sizeof(a->session_compact) &&
	       a->forward_tree && a->session_compact;
}
static mg_status t_forward_tree(const mg_api *a, mg_stack *s, const mg_tree_step *steps, int32_t n_steps, int32_t first,
		int32_t last, int32_t dtype, const void *in, void *out, char *err, size_t errlen) {
	MG_RET(a->forward_tree(s, steps, n_steps, first, last, dtype, in, out));
}
static mg_status t_session_compact(const mg_api *a, mg_session *se, int32_t dst, const int32_t *src, int32_t n,
		char *err, size_t errlen) {
	MG_RET(a->session_compact(se, dst, src, n));
}
static mg_status t_logits(const mg_api *a, mg_stack *s, int32_t rows, int32_t dtype, const void *in, float *out, char *err, size_t errlen) {
	MG_RET(a->logits(s, rows, dtype, in, out));
}
*/
import "C"

import (
	"fmt"
	"math"
	"runtime"
	"sync"
	"unsafe"
)

const errBufLen = 512

type errBuf [errBufLen]C.char

func (e *errBuf) ptr() (*C.char, C.size_t) { return &e[0], errBufLen }

func (e *errBuf) check(op string, st C.mg_status) error {
	if st == C.MG_OK {
		return nil
	}
	return &Error{Status: Status(st), Op: op, Msg: C.GoString(&e[0])}
}

func invalid(op, format string, args ...any) error {
	return &Error{Status: StatusInvalidArgument, Op: op, Msg: fmt.Sprintf(format, args...)}
}

// cBackend wraps one mg_api implementation (the CPU backend compiled in, or
// a dlopened CUDA library) and one opened backend handle.
type cBackend struct {
	api  *C.mg_api
	name string

	mu     sync.Mutex // guards b, stacks, hosts
	b      *C.mg_backend
	stacks map[*cStack]struct{}
	// hosts are the live AllocHost buffers. Close frees them, so a
	// HostBuffer's Free must find itself here to free anything: after Close
	// the backend handle is gone, and freeing through it would read freed
	// memory (CUDA) or free twice.
	hosts map[*hostAlloc]struct{}
}

// hostAlloc is one AllocHost allocation; its address is its identity (a
// freed ptr may be handed out again by the allocator).
type hostAlloc struct{ ptr unsafe.Pointer }

// backendOptions mirrors mg_backend_options, field for field.
type backendOptions struct {
	device, threads, attention, prefillAttention, noGraphs, batchMMA, fusedDecode int32
}

func optionsOf(opts Options) (backendOptions, error) {
	if opts.Device < 0 || opts.Device > math.MaxInt32 || opts.Threads < 0 || opts.Threads > 4096 {
		return backendOptions{}, invalid("backend_open", "device %d or threads %d out of range", opts.Device, opts.Threads)
	}
	b := func(v bool) int32 {
		if v {
			return 1
		}
		return 0
	}
	return backendOptions{device: int32(opts.Device), threads: int32(opts.Threads), attention: b(opts.CUDA.AttentionF32),
		prefillAttention: b(opts.CUDA.PrefillTiled), noGraphs: b(opts.CUDA.NoGraphs), batchMMA: b(opts.CUDA.BatchMMA),
		fusedDecode: b(opts.CUDA.FusedDecode)}, nil
}

func openAPI(api *C.mg_api, name string, o backendOptions) (*cBackend, error) {
	co := C.mg_backend_options{device: C.int32_t(o.device), threads: C.int32_t(o.threads), attention: C.int32_t(o.attention),
		prefill_attention: C.int32_t(o.prefillAttention), no_graphs: C.int32_t(o.noGraphs), batch_mma: C.int32_t(o.batchMMA),
		fused_decode: C.int32_t(o.fusedDecode)}
	var eb errBuf
	var b *C.mg_backend
	p, n := eb.ptr()
	if err := eb.check("backend_open", C.t_backend_open(api, &co, &b, p, n)); err != nil {
		return nil, err
	}
	return &cBackend{api: api, name: name, b: b, stacks: map[*cStack]struct{}{}, hosts: map[*hostAlloc]struct{}{}}, nil
}

func (be *cBackend) Name() string { return be.name }

func (be *cBackend) Describe() string {
	be.mu.Lock()
	defer be.mu.Unlock()
	if be.b == nil {
		return be.name + " (closed)"
	}
	return C.GoString(C.t_backend_describe(be.api, be.b))
}

func (be *cBackend) Memory() (free, total uint64, err error) {
	be.mu.Lock()
	defer be.mu.Unlock()
	if be.b == nil {
		return 0, 0, invalid("backend_memory", "backend is closed")
	}
	var eb errBuf
	var f, t C.uint64_t
	p, n := eb.ptr()
	if err := eb.check("backend_memory", C.t_backend_memory(be.api, be.b, &f, &t, p, n)); err != nil {
		return 0, 0, err
	}
	return uint64(f), uint64(t), nil
}

func (be *cBackend) AllocHost(nbytes int) (*HostBuffer, error) {
	if nbytes <= 0 {
		return nil, invalid("host_alloc", "%d bytes", nbytes)
	}
	be.mu.Lock()
	defer be.mu.Unlock()
	if be.b == nil {
		return nil, invalid("host_alloc", "backend is closed")
	}
	var eb errBuf
	var ptr unsafe.Pointer
	p, n := eb.ptr()
	if err := eb.check("host_alloc", C.t_host_alloc(be.api, be.b, C.size_t(nbytes), &ptr, p, n)); err != nil {
		return nil, err
	}
	ha := &hostAlloc{ptr: ptr}
	be.hosts[ha] = struct{}{}
	return &HostBuffer{
		Bytes: unsafe.Slice((*byte)(ptr), nbytes),
		free:  func() { be.freeHost(ha) },
	}, nil
}

// freeHost frees ha unless Close already did (then it is a no-op).
func (be *cBackend) freeHost(ha *hostAlloc) {
	be.mu.Lock()
	defer be.mu.Unlock()
	if _, ok := be.hosts[ha]; !ok || be.b == nil {
		return
	}
	delete(be.hosts, ha)
	C.t_host_free(be.api, be.b, ha.ptr)
}

// liveHostBuffers counts AllocHost buffers not yet freed (for tests).
func (be *cBackend) liveHostBuffers() int {
	be.mu.Lock()
	defer be.mu.Unlock()
	return len(be.hosts)
}

func (be *cBackend) NewStack(cfg StackConfig) (Stack, error) {
	cc, err := cConfig(cfg)
	if err != nil {
		return nil, err
	}
	be.mu.Lock()
	defer be.mu.Unlock()
	if be.b == nil {
		return nil, invalid("stack_create", "backend is closed")
	}
	var eb errBuf
	var s *C.mg_stack
	p, n := eb.ptr()
	if err := eb.check("stack_create", C.t_stack_create(be.api, be.b, &cc, &s, p, n)); err != nil {
		return nil, err
	}
	st := &cStack{be: be, s: s, cfg: cfg, sessions: map[*cSession]struct{}{}}
	be.stacks[st] = struct{}{}
	return st, nil
}

// Close frees every stack (and its sessions) still open, every host buffer
// still live (their Free becomes a no-op), then the backend. Stacks are
// closed without be.mu held (a stack's Close takes it), so one created
// meanwhile is caught by the next round; the backend goes only when a round
// finds none.
func (be *cBackend) Close() error {
	for {
		be.mu.Lock()
		stacks := be.stacks
		if len(stacks) == 0 {
			if be.b != nil {
				for ha := range be.hosts {
					C.t_host_free(be.api, be.b, ha.ptr)
				}
				clear(be.hosts)
				C.t_backend_close(be.api, be.b)
				be.b = nil
			}
			be.mu.Unlock()
			return nil
		}
		be.stacks = map[*cStack]struct{}{}
		be.mu.Unlock()
		for st := range stacks {
			st.Close()
		}
	}
}

func i32(op, what string, v int) (C.int32_t, error) {
	if v < math.MinInt32 || v > math.MaxInt32 {
		return 0, invalid(op, "%s %d out of range", what, v)
	}
	return C.int32_t(v), nil
}

func cConfig(c StackConfig) (C.mg_stack_config, error) {
	var cc C.mg_stack_config
	fields := []struct {
		name string
		v    int
		dst  *C.int32_t
	}{
		{"hidden", c.Hidden, &cc.hidden}, {"intermediate", c.Intermediate, &cc.intermediate},
		{"heads", c.Heads, &cc.n_heads}, {"kv heads", c.KVHeads, &cc.n_kv_heads},
		{"head dim", c.HeadDim, &cc.head_dim}, {"vocab", c.Vocab, &cc.vocab},
		{"layers", c.NumLayers, &cc.n_layers}, {"first layer", c.First, &cc.first_layer},
		{"last layer", c.Last, &cc.last_layer}, {"max context", c.MaxContext, &cc.max_context},
		{"rope original max positions", c.Rope.OrigMaxPos, &cc.rope_original_max_pos},
	}
	for _, f := range fields {
		v, err := i32("stack_create", f.name, f.v)
		if err != nil {
			return cc, err
		}
		*f.dst = v
	}
	b := func(v bool) C.int32_t {
		if v {
			return 1
		}
		return 0
	}
	cc.has_embed, cc.has_head, cc.qkv_bias = b(c.HasEmbed), b(c.HasHead), b(c.QKVBias)
	cc.rms_eps = C.float(c.RMSEps)
	cc.rope_type = C.int32_t(c.Rope.Type)
	cc.rope_theta = C.float(c.Rope.Theta)
	cc.rope_factor = C.float(c.Rope.Factor)
	cc.rope_low_freq_factor = C.float(c.Rope.LowFreqFactor)
	cc.rope_high_freq_factor = C.float(c.Rope.HighFreqFactor)
	if len(c.Rope.FreqFactors) > 0 {
		if len(c.Rope.FreqFactors) != c.HeadDim/2 || len(c.Rope.FreqFactors) > len(cc.rope_freq_factors) {
			return cc, invalid("stack_create", "%d rope frequency factors for head_dim %d (want head_dim/2)", len(c.Rope.FreqFactors), c.HeadDim)
		}
		for i, f := range c.Rope.FreqFactors {
			cc.rope_freq_factors[i] = C.float(f)
		}
	}
	return cc, nil
}

// cStack is one mg_stack. mu serializes every call on it and its sessions
// (meshgpu.h lets a backend assume calls on one stack never overlap: the CPU
// backend takes no lock of its own; the CUDA one also locks per stack) and
// guards the session set.
type cStack struct {
	be  *cBackend
	cfg StackConfig

	mu       sync.Mutex
	s        *C.mg_stack // nil once closed
	sessions map[*cSession]struct{}
}

func (st *cStack) Config() StackConfig { return st.cfg }

func (st *cStack) SetTensor(t Tensor) error {
	const op = "set_tensor"
	if len(t.Shape) == 0 || len(t.Shape) > 4 {
		return invalid(op, "tensor kind %d: %d dimensions", t.Kind, len(t.Shape))
	}
	shape := make([]C.int64_t, len(t.Shape))
	for i, d := range t.Shape {
		shape[i] = C.int64_t(d)
	}
	if len(t.Data) == 0 {
		return invalid(op, "tensor kind %d: no data", t.Kind)
	}
	if err := checkQuantized(t); err != nil {
		return err
	}
	kind, err := i32(op, "kind", int(t.Kind))
	if err != nil {
		return err
	}
	layer, err := i32(op, "layer", t.Layer)
	if err != nil {
		return err
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.s == nil {
		return invalid(op, "stack is closed")
	}
	var eb errBuf
	p, n := eb.ptr()
	return eb.check(op, C.t_stack_set_tensor(st.be.api, st.s, kind, layer, C.int32_t(t.DType), &shape[0],
		C.int32_t(len(shape)), unsafe.Pointer(&t.Data[0]), C.size_t(len(t.Data)), p, n))
}

func (st *cStack) Ready() error {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.s == nil {
		return invalid("stack_ready", "stack is closed")
	}
	var eb errBuf
	p, n := eb.ptr()
	return eb.check("stack_ready", C.t_stack_ready(st.be.api, st.s, p, n))
}

func (st *cStack) NewSession(maxTokens int) (Session, error) {
	mt, err := i32("session_create", "max tokens", maxTokens)
	if err != nil {
		return nil, err
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.s == nil {
		return nil, invalid("session_create", "stack is closed")
	}
	var eb errBuf
	var se *C.mg_session
	p, n := eb.ptr()
	if err := eb.check("session_create", C.t_session_create(st.be.api, st.s, mt, &se, p, n)); err != nil {
		return nil, err
	}
	s := &cSession{st: st, s: se}
	st.sessions[s] = struct{}{}
	return s, nil
}

// checkQuantized checks a block-quantized tensor's bytes against its shape
// before the backend sees it: a matrix whose rows are whole blocks, and
// exactly rows x row_bytes bytes.
func checkQuantized(t Tensor) error {
	const op = "set_tensor"
	if !t.DType.Quantized() {
		return nil
	}
	if len(t.Shape) != 2 || t.Shape[0] <= 0 || t.Shape[1] <= 0 {
		return invalid(op, "tensor kind %d: a %s tensor must be a matrix, not shape %v", t.Kind, t.DType, t.Shape)
	}
	rb, err := t.DType.RowBytes(t.Shape[1])
	if err != nil {
		return invalid(op, "tensor kind %d shape %v: %v", t.Kind, t.Shape, err)
	}
	if want := int64(t.Shape[0]) * int64(rb); int64(len(t.Data)) != want {
		return invalid(op, "tensor kind %d: %d bytes of %s, want %d for shape %v (%d rows of %d bytes)",
			t.Kind, len(t.Data), t.DType, want, t.Shape, t.Shape[0], rb)
	}
	return nil
}

// rowBytes checks that buf holds at least rows rows of width elements of dtype.
func rowBytes(op, what string, buf []byte, rows, width int, dtype DType) error {
	if dtype != F32 && dtype != BF16 {
		return invalid(op, "activation dtype %s (want f32 or bf16)", dtype)
	}
	need := int64(rows) * int64(width) * int64(dtype.Size())
	if int64(len(buf)) < need {
		return invalid(op, "%s holds %d bytes, want %d (%d rows of %d %s)", what, len(buf), need, rows, width, dtype)
	}
	return nil
}

func (st *cStack) Embed(tokens []int32, dtype DType, out []byte) error {
	const op = "embed"
	if len(tokens) == 0 || len(tokens) > math.MaxInt32 {
		return invalid(op, "%d tokens", len(tokens))
	}
	if err := rowBytes(op, "out", out, len(tokens), st.cfg.Hidden, dtype); err != nil {
		return err
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.s == nil {
		return invalid(op, "stack is closed")
	}
	var eb errBuf
	p, n := eb.ptr()
	return eb.check(op, C.t_embed(st.be.api, st.s, (*C.int32_t)(&tokens[0]), C.int32_t(len(tokens)),
		C.int32_t(dtype), unsafe.Pointer(&out[0]), p, n))
}

// Forward runs forward, or forward_tree when a step carries a token tree.
func (st *cStack) Forward(steps []Step, first, last int, dtype DType, in, out []byte) error {
	op := "forward"
	if len(steps) == 0 || len(steps) > 65536 {
		return invalid(op, "%d steps", len(steps))
	}
	cf, err := i32(op, "first layer", first)
	if err != nil {
		return err
	}
	cl, err := i32(op, "last layer", last)
	if err != nil {
		return err
	}
	tree := false
	for _, s := range steps {
		tree = tree || s.Parents != nil
	}
	if tree {
		op = "forward_tree"
		if !st.HasTrees() {
			return &Error{Status: StatusUnsupported, Op: op, Msg: "this backend's library has no token trees"}
		}
	}
	cs := make([]C.mg_tree_step, len(steps))
	var pin runtime.Pinner // cs, Go memory, holds pointers to the parents
	defer pin.Unpin()
	rows := 0
	for i, s := range steps {
		se, ok := s.Session.(*cSession)
		if !ok || se == nil || se.st != st {
			return invalid(op, "step %d: session does not belong to this stack", i)
		}
		if s.NTokens <= 0 || s.NTokens > math.MaxInt32 || s.Pos < 0 || s.Pos > math.MaxInt32 {
			return invalid(op, "step %d: position %d, %d tokens", i, s.Pos, s.NTokens)
		}
		if s.Parents != nil && (len(s.Parents) != s.NTokens || s.NTokens > MaxTreeRows) {
			return invalid(op, "step %d: %d parents for %d rows (at most %d)", i, len(s.Parents), s.NTokens, MaxTreeRows)
		}
		rows += s.NTokens
		if rows > 1<<24 {
			return invalid(op, "too many rows")
		}
		cs[i] = C.mg_tree_step{pos: C.int32_t(s.Pos), n_tokens: C.int32_t(s.NTokens)}
		if s.Parents != nil {
			pin.Pin(&s.Parents[0])
			cs[i].parents = (*C.int32_t)(&s.Parents[0])
		}
	}
	if err := rowBytes(op, "in", in, rows, st.cfg.Hidden, dtype); err != nil {
		return err
	}
	if err := rowBytes(op, "out", out, rows, st.cfg.Hidden, dtype); err != nil {
		return err
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.s == nil {
		return invalid(op, "stack is closed")
	}
	for i, s := range steps {
		se := s.Session.(*cSession)
		if se.s == nil {
			return invalid(op, "step %d: session is closed", i)
		}
		cs[i].session = se.s
	}
	var eb errBuf
	p, n := eb.ptr()
	if tree {
		return eb.check(op, C.t_forward_tree(st.be.api, st.s, &cs[0], C.int32_t(len(cs)), cf, cl, C.int32_t(dtype),
			unsafe.Pointer(&in[0]), unsafe.Pointer(&out[0]), p, n))
	}
	chain := make([]C.mg_step, len(cs))
	for i, c := range cs {
		chain[i] = C.mg_step{session: c.session, pos: c.pos, n_tokens: c.n_tokens}
	}
	return eb.check(op, C.t_forward(st.be.api, st.s, &chain[0], C.int32_t(len(chain)), cf, cl, C.int32_t(dtype),
		unsafe.Pointer(&in[0]), unsafe.Pointer(&out[0]), p, n))
}

// HasTrees implements TreeStack.
func (st *cStack) HasTrees() bool { return C.tree_has(st.be.api) != 0 }

func (st *cStack) Logits(rows int, dtype DType, in []byte, out []float32) error {
	const op = "logits"
	if rows <= 0 || rows > 1<<20 {
		return invalid(op, "%d rows", rows)
	}
	if err := rowBytes(op, "in", in, rows, st.cfg.Hidden, dtype); err != nil {
		return err
	}
	if int64(len(out)) < int64(rows)*int64(st.cfg.Vocab) {
		return invalid(op, "out holds %d values, want %d (%d rows of %d)", len(out), rows*st.cfg.Vocab, rows, st.cfg.Vocab)
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.s == nil {
		return invalid(op, "stack is closed")
	}
	var eb errBuf
	p, n := eb.ptr()
	return eb.check(op, C.t_logits(st.be.api, st.s, C.int32_t(rows), C.int32_t(dtype), unsafe.Pointer(&in[0]),
		(*C.float)(&out[0]), p, n))
}

// Close frees the stack's sessions and then the stack.
func (st *cStack) Close() error {
	st.mu.Lock()
	if st.s != nil {
		for se := range st.sessions {
			C.t_session_free(st.be.api, se.s)
			se.s = nil
		}
		st.sessions = nil
		C.t_stack_free(st.be.api, st.s)
		st.s = nil
	}
	st.mu.Unlock()
	st.be.mu.Lock()
	delete(st.be.stacks, st)
	st.be.mu.Unlock()
	return nil
}

// cSession is one mg_session; its stack's mutex guards it.
type cSession struct {
	st *cStack
	s  *C.mg_session // nil once closed
}

func (se *cSession) Len() int {
	se.st.mu.Lock()
	defer se.st.mu.Unlock()
	if se.s == nil {
		return 0
	}
	return int(C.t_session_len(se.st.be.api, se.s))
}

// Compact implements Compacter (meshgpu.h session_compact).
func (se *cSession) Compact(dst int, src []int32) error {
	const op = "session_compact"
	if dst < 0 || dst > math.MaxInt32 || len(src) > math.MaxInt32 {
		return invalid(op, "%d slots to %d", len(src), dst)
	}
	se.st.mu.Lock()
	defer se.st.mu.Unlock()
	if se.s == nil {
		return invalid(op, "session is closed")
	}
	if C.tree_has(se.st.be.api) == 0 {
		return &Error{Status: StatusUnsupported, Op: op, Msg: "this backend's library predates token trees; rebuild it"}
	}
	var ps *C.int32_t
	if len(src) > 0 {
		ps = (*C.int32_t)(&src[0])
	}
	var eb errBuf
	p, n := eb.ptr()
	return eb.check(op, C.t_session_compact(se.st.be.api, se.s, C.int32_t(dst), ps, C.int32_t(len(src)), p, n))
}

func (se *cSession) Close() error {
	se.st.mu.Lock()
	defer se.st.mu.Unlock()
	if se.s != nil {
		C.t_session_free(se.st.be.api, se.s)
		se.s = nil
		delete(se.st.sessions, se)
	}
	return nil
}

// MaxTreeRows is MG_MAX_TREE_ROWS (the index is out of range otherwise).
var _ = [1]struct{}{}[MaxTreeRows-C.MG_MAX_TREE_ROWS]
