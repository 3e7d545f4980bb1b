// Package model reads Hugging Face model directories: config.json (both the
// transformers 5 rope_parameters form and the legacy rope_theta/rope_scaling
// form) and safetensors checkpoints, single-file or sharded, mmapped so a node
// touches only the bytes of the layers it holds. It also writes random-weight
// directories in the real layout (Synth) for tests and benchmarks.
package model

import "fmt"

// DType is a tensor element type, spelled as safetensors spells it.
type DType string

// The float types the backends compute with.
const (
	BF16 DType = "BF16"
	F16  DType = "F16"
	F32  DType = "F32"
)

// dtypeSizes holds every dtype the safetensors format defines, so a
// checkpoint holding, say, an I64 buffer still parses; the loaders accept
// only IsFloat types.
var dtypeSizes = map[DType]int{
	"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
	"I16": 2, "U16": 2, F16: 2, BF16: 2,
	"I32": 4, "U32": 4, F32: 4,
	"I64": 8, "U64": 8, "F64": 8,
}

// Size is the byte size of one element, 0 for an unknown dtype.
func (d DType) Size() int { return dtypeSizes[d] }

// ggml's block-quantized types that a GGUF file's matrices may hold and the
// CPU backend loads as they are (its tensors' Data are the file's blocks).
const (
	Q8_0 DType = "Q8_0"
	Q4_K DType = "Q4_K"
	Q5_K DType = "Q5_K"
	Q6_K DType = "Q6_K"
)

// IsFloat reports whether d is one of BF16, F16, F32, the float types the
// backends load.
func (d DType) IsFloat() bool { return d == BF16 || d == F16 || d == F32 }

// IsQuantized reports whether d is one of the block-quantized types the CPU
// backend loads: Q8_0, Q4_K, Q5_K, Q6_K.
func (d DType) IsQuantized() bool { return d == Q8_0 || d == Q4_K || d == Q5_K || d == Q6_K }

// ParseDType reads a safetensors dtype ("BF16") or a torch dtype name
// ("bfloat16", "float16", "float32").
func ParseDType(s string) (DType, error) {
	switch s {
	case "bfloat16", "bf16":
		return BF16, nil
	case "float16", "f16", "half":
		return F16, nil
	case "float32", "f32", "float":
		return F32, nil
	}
	if dtypeSizes[DType(s)] != 0 {
		return DType(s), nil
	}
	return "", fmt.Errorf("unknown dtype %q (want BF16, F16 or F32)", s)
}
