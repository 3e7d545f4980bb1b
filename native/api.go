// Package native is the only Go package that imports "C". It holds the C ABI
// (meshgpu.h), the CPU backend written in C, and the loader that dlopens the
// CUDA backend. Everything else in meshgpu sees its Go interfaces: Backend,
// Stack and Session in this file, Ends (ends.go) and the op tables tests and
// kernel benchmarks call one op at a time through (ops*.go).
package native

import (
	"errors"
	"fmt"
	"strings"
)

// DType is an element type of weights and activations. Values match mg_dtype.
type DType int32

const (
	F32  DType = 0
	F16  DType = 1
	BF16 DType = 2
	// Block-quantized weight types (meshgpu.h), numbered as ggml numbers
	// them: tensors of these hold the GGUF file's blocks.
	Q8_0 DType = 8
	Q4_K DType = 12
	Q5_K DType = 13
	Q6_K DType = 14
)

// Size is the byte size of one element; 0 for a block-quantized type (see
// Block).
func (d DType) Size() int {
	switch d {
	case F32:
		return 4
	case F16, BF16:
		return 2
	}
	return 0
}

// Quantized reports whether d is one of the block-quantized weight types.
func (d DType) Quantized() bool { return d == Q8_0 || d == Q4_K || d == Q5_K || d == Q6_K }

// Block is the elements and bytes of one block of d: 1 and Size for a
// float type, 0, 0 for an unknown one.
func (d DType) Block() (elems, bytes int) {
	switch d {
	case Q8_0:
		return 32, 34
	case Q4_K:
		return 256, 144
	case Q5_K:
		return 256, 176
	case Q6_K:
		return 256, 210
	}
	if s := d.Size(); s > 0 {
		return 1, s
	}
	return 0, 0
}

// RowBytes is the size of a row of cols elements of d, or an error when
// d is unknown or cols is not a whole number of its blocks.
func (d DType) RowBytes(cols int) (int, error) {
	elems, bytes := d.Block()
	if elems == 0 {
		return 0, fmt.Errorf("unknown dtype %s", d)
	}
	if cols <= 0 || cols%elems != 0 {
		return 0, fmt.Errorf("a row of %d %s elements is not a whole number of %d-element blocks", cols, d, elems)
	}
	return cols / elems * bytes, nil
}

func (d DType) String() string {
	switch d {
	case F32:
		return "f32"
	case F16:
		return "f16"
	case BF16:
		return "bf16"
	case Q8_0:
		return "q8_0"
	case Q4_K:
		return "q4_k"
	case Q5_K:
		return "q5_k"
	case Q6_K:
		return "q6_k"
	}
	return fmt.Sprintf("dtype(%d)", int32(d))
}

// ParseDType reads "f32", "f16" or "bf16" (any case; "float32", "bfloat16" too).
func ParseDType(s string) (DType, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "f32", "float32", "fp32":
		return F32, nil
	case "f16", "float16", "fp16":
		return F16, nil
	case "bf16", "bfloat16":
		return BF16, nil
	}
	return 0, fmt.Errorf("unknown dtype %q (want bf16, f16 or f32)", s)
}

// TensorKind is a tensor's role in a layer stack. Values match mg_tensor_kind.
type TensorKind int32

const (
	TokEmbed TensorKind = iota
	FinalNorm
	LMHead
	AttnNorm
	WQ
	WK
	WV
	BQ
	BK
	BV
	WO
	MLPNorm
	WGate
	WUp
	WDown
)

// RopeType values match mg_rope_type.
type RopeType int32

const (
	RopeDefault RopeType = 0
	RopeLlama3  RopeType = 1
)

// Rope holds rotary embedding parameters.
type Rope struct {
	Type           RopeType
	Theta          float32
	Factor         float32 // llama3 only
	LowFreqFactor  float32 // llama3 only
	HighFreqFactor float32 // llama3 only
	OrigMaxPos     int     // llama3 only
	// FreqFactors, when set, divide the frequencies after Type's scaling:
	// head_dim/2 of them, as a GGUF file's rope_freqs tensor gives them.
	FreqFactors []float32
}

// StackConfig describes the weights one stack holds. Mirrors mg_stack_config.
type StackConfig struct {
	Hidden, Intermediate int
	Heads, KVHeads       int
	HeadDim              int
	Vocab                int
	NumLayers            int // layers in the whole model
	First, Last          int // layers held, inclusive; Last < First holds none
	HasEmbed, HasHead    bool
	QKVBias              bool
	MaxContext           int
	RMSEps               float32
	Rope                 Rope
}

// Tensor is one weight handed to a stack. Data may be mmapped; the backend
// copies it during SetTensor. A block-quantized matrix (DType.Quantized,
// CPU backend only) is Shape[0] rows of DType.RowBytes(Shape[1]) bytes of
// ggml blocks, exactly; anything else is refused with one error.
type Tensor struct {
	Kind  TensorKind
	Layer int // global layer index; -1 for whole-model tensors
	DType DType
	Shape []int
	Data  []byte
}

// Step is one sequence's share of a Forward call: NTokens rows at positions
// Pos..Pos+NTokens-1. Pos must not exceed the session's length; a smaller Pos
// truncates the cache first, so a retried hop is idempotent.
type Step struct {
	Session Session
	Pos     int
	NTokens int
	// Parents, when not nil, makes the rows a token tree (meshgpu.h
	// mg_tree_step): Parents[i] is row i's parent row (< i) or -1 for a
	// root; row i runs at position Pos+depth(i), sees the cache and its
	// ancestors only, and its K/V take slot Pos+i (Compacter keeps a
	// branch). At most MaxTreeRows rows.
	Parents []int32
}

// MaxTreeRows bounds the rows of a Step with Parents (MG_MAX_TREE_ROWS).
const MaxTreeRows = 256

// TreeStack is implemented by stacks that may run token trees: HasTrees
// reports whether the backend has the calls (a CUDA library built before
// them, or without them, does not).
type TreeStack interface {
	HasTrees() bool
}

// Compacter is implemented by sessions whose backend keeps one branch of
// a token tree (meshgpu.h session_compact): Compact moves the K/V at slots
// src (increasing, src[j] >= dst+j) to dst, dst+1, ... and truncates the
// session to dst+len(src).
type Compacter interface {
	Compact(dst int, src []int32) error
}

// Backend is a device that holds stacks: "cpu" or "cuda".
type Backend interface {
	Name() string
	Describe() string
	// Memory reports free and total bytes where weights and caches live.
	Memory() (free, total uint64, err error)
	// AllocHost returns host memory for activations, pinned on CUDA.
	AllocHost(nbytes int) (*HostBuffer, error)
	NewStack(cfg StackConfig) (Stack, error)
	Close() error
}

// Stack is the weights of a contiguous layer range (plus embeddings and/or
// the final norm and LM head). Its methods (and its sessions') are safe for
// concurrent use: the binding serializes the calls on one stack (cStack.mu),
// since meshgpu.h does not ask a backend to be reentrant per stack. Calls on
// different stacks may run at once.
type Stack interface {
	Config() StackConfig
	SetTensor(t Tensor) error
	// Ready checks that every tensor the config needs was set.
	Ready() error
	NewSession(maxTokens int) (Session, error)
	// Embed writes len(tokens) rows of Hidden elements of dtype into out.
	Embed(tokens []int32, dtype DType, out []byte) error
	// Forward runs layers first..last (inclusive) for every step. in and out
	// hold the concatenated rows of all steps in dtype; they may alias.
	Forward(steps []Step, first, last int, dtype DType, in, out []byte) error
	// Logits applies the final norm and LM head to rows rows of in; out holds
	// rows*Vocab values.
	Logits(rows int, dtype DType, in []byte, out []float32) error
	Close() error
}

// Session is one sequence's KV cache on one stack.
type Session interface {
	Len() int
	Close() error
}

// HostBuffer is host memory owned by a backend (pinned on CUDA). Bytes is
// valid until Free.
type HostBuffer struct {
	Bytes []byte
	free  func()
}

// Free releases the buffer; Bytes must not be used afterwards.
func (h *HostBuffer) Free() {
	if h.free != nil {
		h.free()
		h.free = nil
	}
	h.Bytes = nil
}

// Status mirrors mg_status.
type Status int32

const (
	StatusOK              Status = 0
	StatusInvalidArgument Status = 1
	StatusOutOfMemory     Status = 2
	StatusCapacity        Status = 3
	StatusUnsupported     Status = 4
	StatusBackend         Status = 5
	// StatusNonFinite: the model's logits hold NaN or +Inf, so the
	// backend sampled no token (Ends.TailForward, Ends.Decode).
	StatusNonFinite Status = 6
)

func (s Status) String() string {
	switch s {
	case StatusOK:
		return "ok"
	case StatusInvalidArgument:
		return "invalid argument"
	case StatusOutOfMemory:
		return "out of memory"
	case StatusCapacity:
		return "capacity exceeded"
	case StatusUnsupported:
		return "unsupported"
	case StatusBackend:
		return "backend failure"
	case StatusNonFinite:
		return "non-finite logits"
	}
	return fmt.Sprintf("status(%d)", int32(s))
}

// Error is a failed native call.
type Error struct {
	Status Status
	Op     string
	Msg    string
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s: %s: %s", e.Op, e.Status, e.Msg)
}

// IsStatus reports whether err is a native *Error with status s.
func IsStatus(err error, s Status) bool {
	var ne *Error
	return errors.As(err, &ne) && ne.Status == s
}

// Options select and tune a backend in Open. They reach the backend as
// meshgpu.h's mg_backend_options: the library reads no environment.
type Options struct {
	// CUDALib is the path of libmeshgpu_cuda.so. Empty: $MESHGPU_CUDA_LIB,
	// then next to the executable.
	CUDALib string
	Device  int // GPU ordinal
	Threads int // CPU threads; 0 = all cores
	// CUDA are the CUDA backend's kernel settings; the CPU backend accepts
	// them and computes f32 math whatever they say.
	CUDA CUDASettings
	// CPUISA forces the CPU backend's matrix-product path (avx2, avx512f,
	// avx512bf16; CPUISAs lists this machine's); empty keeps the default.
	// The path is process-wide: it applies to every CPU backend.
	CPUISA string
	// CPUQuantAct is the activations' width in products of quantized weights
	// (8: llama.cpp's int8 blocks, cpu_quant8.c; 16: cpu_quant.c's). 0:
	// $MESHGPU_CPU_QUANT_ACT, else 16 (native/cpu_isa.c says why).
	// Process-wide.
	CPUQuantAct int
}

// CUDASettings choose the CUDA backend's numerics and kernels
// (docs/cuda-settings.md; meshgpu's --cuda-* flags). The zero value is the
// default: HF's bf16 attention numerics, cuBLAS prefill attention while its
// scratch fits, decode through CUDA graphs.
type CUDASettings struct {
	// AttentionF32 computes attention flash-style (f32 scores and online
	// softmax) instead of as PyTorch's math SDPA in bf16 (what HF runs).
	AttentionF32 bool
	// PrefillTiled runs prefill attention through the tiled kernel, never
	// through cuBLAS.
	PrefillTiled bool
	// NoGraphs decodes without capturing CUDA graphs.
	NoGraphs bool
	// BatchMMA runs the decode matrix-vector products (1-16 rows) on
	// tensor-core tiles (kernels/matvec_mma.cu) instead of the FMA kernels.
	BatchMMA bool
	// FusedDecode, for single-token steps, does the RoPE and the KV-cache
	// append inside decode attention (kernels/attention_fused.cu: two
	// launches a layer fewer) and captures the embedding and a tail's final
	// norm and LM head in the decode graph; the same bits.
	FusedDecode bool
}
