package gguf

import (
	"fmt"
	"math"
)

// KV is one metadata key/value pair.
type KV struct {
	Key   string
	Value Value
}

// Value is a metadata value. Scalars hold their Go value; arrays hold a
// typed slice by element kind: []string, []bool, []float64 (float32 and
// float64 elements), []int64 (every integer type but uint64), []uint64, or
// []Value for arrays of arrays. Elem keeps the encoded element type so a
// value writes back as it was read.
type Value struct {
	Type ValueType
	Elem ValueType // arrays only
	v    any
}

// Scalar constructors, for writers.
func Uint8(x uint8) Value     { return Value{Type: TypeUint8, v: x} }
func Int8(x int8) Value       { return Value{Type: TypeInt8, v: x} }
func Uint16(x uint16) Value   { return Value{Type: TypeUint16, v: x} }
func Int16(x int16) Value     { return Value{Type: TypeInt16, v: x} }
func Uint32(x uint32) Value   { return Value{Type: TypeUint32, v: x} }
func Int32(x int32) Value     { return Value{Type: TypeInt32, v: x} }
func Uint64(x uint64) Value   { return Value{Type: TypeUint64, v: x} }
func Int64(x int64) Value     { return Value{Type: TypeInt64, v: x} }
func Float32(x float32) Value { return Value{Type: TypeFloat32, v: x} }
func Float64(x float64) Value { return Value{Type: TypeFloat64, v: x} }
func Bool(x bool) Value       { return Value{Type: TypeBool, v: x} }
func String(x string) Value   { return Value{Type: TypeString, v: x} }

// Array constructors.
func Strings(x []string) Value { return Value{Type: TypeArray, Elem: TypeString, v: x} }
func Bools(x []bool) Value     { return Value{Type: TypeArray, Elem: TypeBool, v: x} }

// Ints is an array of integers encoded as elem (an integer type other
// than uint64).
func Ints(elem ValueType, x []int64) Value { return Value{Type: TypeArray, Elem: elem, v: x} }

// Floats is an array encoded as elem (TypeFloat32 or TypeFloat64).
func Floats(elem ValueType, x []float64) Value { return Value{Type: TypeArray, Elem: elem, v: x} }

// Arrays is an array of arrays.
func Arrays(x []Value) Value { return Value{Type: TypeArray, Elem: TypeArray, v: x} }

// Uint reads any integer scalar that is not negative.
func (v Value) Uint() (uint64, bool) {
	switch x := v.v.(type) {
	case uint8:
		return uint64(x), true
	case uint16:
		return uint64(x), true
	case uint32:
		return uint64(x), true
	case uint64:
		return x, true
	case int8, int16, int32, int64:
		i, _ := v.Int()
		return uint64(i), i >= 0
	}
	return 0, false
}

// Int reads any integer scalar that fits an int64.
func (v Value) Int() (int64, bool) {
	switch x := v.v.(type) {
	case int8:
		return int64(x), true
	case int16:
		return int64(x), true
	case int32:
		return int64(x), true
	case int64:
		return x, true
	case uint8, uint16, uint32:
		u, _ := v.Uint()
		return int64(u), true
	case uint64:
		return int64(x), x <= math.MaxInt64
	}
	return 0, false
}

// Float reads a float scalar, or an integer one as a float.
func (v Value) Float() (float64, bool) {
	switch x := v.v.(type) {
	case float32:
		return float64(x), true
	case float64:
		return x, true
	}
	if i, ok := v.Int(); ok {
		return float64(i), true
	}
	return 0, false
}

// Str reads a string scalar.
func (v Value) Str() (string, bool) { s, ok := v.v.(string); return s, ok }

// Bool reads a bool scalar.
func (v Value) BoolValue() (bool, bool) { b, ok := v.v.(bool); return b, ok }

// Strings reads an array of strings.
func (v Value) Strings() ([]string, bool) { s, ok := v.v.([]string); return s, ok }

// Ints reads an array of integers (of any type but uint64).
func (v Value) Ints() ([]int64, bool) { s, ok := v.v.([]int64); return s, ok }

// Floats reads an array of floats.
func (v Value) Floats() ([]float64, bool) { s, ok := v.v.([]float64); return s, ok }

// Len is the number of elements of an array, 0 for a scalar.
func (v Value) Len() int {
	switch x := v.v.(type) {
	case []string:
		return len(x)
	case []bool:
		return len(x)
	case []float64:
		return len(x)
	case []int64:
		return len(x)
	case []uint64:
		return len(x)
	case []Value:
		return len(x)
	}
	return 0
}

// String describes the value for messages, eliding long arrays.
func (v Value) String() string {
	if v.Type == TypeArray {
		return fmt.Sprintf("[%d × %s]", v.Len(), v.Elem)
	}
	return fmt.Sprint(v.v)
}
