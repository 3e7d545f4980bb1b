// Package gguf reads and writes GGUF files (ggml's docs/gguf.md, versions 2
// and 3, little-endian): the header, metadata key/values of every type,
// tensor infos and the aligned data section. It parses untrusted bytes:
// every count and length is checked against the bytes that remain before
// anything is allocated for it, so a hostile header costs at most a small
// multiple of its own size.
package gguf

import "fmt"

// Type is a ggml tensor type, numbered as ggml.h numbers them.
type Type uint32

// The ggml types. Only some have kernels here (see model.DType); the rest
// are known so a file holding them parses and is refused by name.
const (
	F32     Type = 0
	F16     Type = 1
	Q4_0    Type = 2
	Q4_1    Type = 3
	Q5_0    Type = 6
	Q5_1    Type = 7
	Q8_0    Type = 8
	Q8_1    Type = 9
	Q2_K    Type = 10
	Q3_K    Type = 11
	Q4_K    Type = 12
	Q5_K    Type = 13
	Q6_K    Type = 14
	Q8_K    Type = 15
	IQ2_XXS Type = 16
	IQ2_XS  Type = 17
	IQ3_XXS Type = 18
	IQ1_S   Type = 19
	IQ4_NL  Type = 20
	IQ3_S   Type = 21
	IQ2_S   Type = 22
	IQ4_XS  Type = 23
	I8      Type = 24
	I16     Type = 25
	I32     Type = 26
	I64     Type = 27
	F64     Type = 28
	IQ1_M   Type = 29
	BF16    Type = 30
	TQ1_0   Type = 34
	TQ2_0   Type = 35
)

type typeInfo struct {
	name       string
	blockElems int // elements per block
	blockBytes int // bytes per block
}

var types = map[Type]typeInfo{
	F32: {"F32", 1, 4}, F16: {"F16", 1, 2}, BF16: {"BF16", 1, 2}, F64: {"F64", 1, 8},
	I8: {"I8", 1, 1}, I16: {"I16", 1, 2}, I32: {"I32", 1, 4}, I64: {"I64", 1, 8},
	Q4_0: {"Q4_0", 32, 18}, Q4_1: {"Q4_1", 32, 20}, Q5_0: {"Q5_0", 32, 22}, Q5_1: {"Q5_1", 32, 24},
	Q8_0: {"Q8_0", 32, 34}, Q8_1: {"Q8_1", 32, 36},
	Q2_K: {"Q2_K", 256, 84}, Q3_K: {"Q3_K", 256, 110}, Q4_K: {"Q4_K", 256, 144},
	Q5_K: {"Q5_K", 256, 176}, Q6_K: {"Q6_K", 256, 210}, Q8_K: {"Q8_K", 256, 292},
	IQ2_XXS: {"IQ2_XXS", 256, 66}, IQ2_XS: {"IQ2_XS", 256, 74}, IQ3_XXS: {"IQ3_XXS", 256, 98},
	IQ1_S: {"IQ1_S", 256, 50}, IQ4_NL: {"IQ4_NL", 32, 18}, IQ3_S: {"IQ3_S", 256, 110},
	IQ2_S: {"IQ2_S", 256, 82}, IQ4_XS: {"IQ4_XS", 256, 136}, IQ1_M: {"IQ1_M", 256, 56},
	TQ1_0: {"TQ1_0", 256, 54}, TQ2_0: {"TQ2_0", 256, 66},
}

// Known reports whether t is a ggml type this package knows the block size of.
func (t Type) Known() bool { _, ok := types[t]; return ok }

// String is ggml's name for the type ("Q4_K"), or "type(N)" for an unknown one.
func (t Type) String() string {
	if ti, ok := types[t]; ok {
		return ti.name
	}
	return fmt.Sprintf("type(%d)", uint32(t))
}

// Block is the number of elements in one block of t and the bytes the
// block takes; 0, 0 for an unknown type.
func (t Type) Block() (elems, bytes int) {
	ti := types[t]
	return ti.blockElems, ti.blockBytes
}

// RowBytes is the size of a row of n elements, or an error when n is not a
// whole number of blocks.
func (t Type) RowBytes(n uint64) (uint64, error) {
	elems, bytes := t.Block()
	if elems == 0 {
		return 0, fmt.Errorf("unknown tensor type %s", t)
	}
	if n%uint64(elems) != 0 {
		return 0, fmt.Errorf("a row of %d elements is not a whole number of %s blocks (%d elements each)", n, t, elems)
	}
	return n / uint64(elems) * uint64(bytes), nil
}

// ValueType is the type tag of a metadata value.
type ValueType uint32

const (
	TypeUint8   ValueType = 0
	TypeInt8    ValueType = 1
	TypeUint16  ValueType = 2
	TypeInt16   ValueType = 3
	TypeUint32  ValueType = 4
	TypeInt32   ValueType = 5
	TypeFloat32 ValueType = 6
	TypeBool    ValueType = 7
	TypeString  ValueType = 8
	TypeArray   ValueType = 9
	TypeUint64  ValueType = 10
	TypeInt64   ValueType = 11
	TypeFloat64 ValueType = 12
)

var valueTypeNames = [...]string{"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string", "array", "uint64", "int64", "float64"}

func (v ValueType) String() string {
	if int(v) < len(valueTypeNames) {
		return valueTypeNames[v]
	}
	return fmt.Sprintf("value type %d", uint32(v))
}

// fixedSize is the encoded size of a scalar of type v; 0 for string, array
// and unknown types.
func (v ValueType) fixedSize() int {
	switch v {
	case TypeUint8, TypeInt8, TypeBool:
		return 1
	case TypeUint16, TypeInt16:
		return 2
	case TypeUint32, TypeInt32, TypeFloat32:
		return 4
	case TypeUint64, TypeInt64, TypeFloat64:
		return 8
	}
	return 0
}
