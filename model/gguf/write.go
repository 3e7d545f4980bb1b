package gguf

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"math"
)

// WriteTensor describes a tensor for Write; Offset and Size are computed.
type WriteTensor struct {
	Name string
	Dims []uint64 // ggml ne order: Dims[0] is the row length
	Type Type
}

// Write writes a GGUF v3 file: kv (general.alignment among them, if not the
// default), the tensor infos, then each tensor's bytes from data, which must
// write exactly that tensor's size. It returns the infos as written.
func Write(w io.Writer, kv []KV, tensors []WriteTensor, data func(i int, w io.Writer) error) ([]TensorInfo, error) {
	align := uint64(DefaultAlignment)
	for _, e := range kv {
		if e.Key == "general.alignment" {
			a, _ := e.Value.Uint()
			if a == 0 || a&(a-1) != 0 {
				return nil, fmt.Errorf("general.alignment %s is not a power of two", e.Value)
			}
			align = a
		}
	}
	infos := make([]TensorInfo, len(tensors))
	var off uint64
	for i, t := range tensors {
		if len(t.Dims) == 0 || len(t.Dims) > maxDims {
			return nil, fmt.Errorf("tensor %q: %d dims", t.Name, len(t.Dims))
		}
		row, err := t.Type.RowBytes(t.Dims[0])
		if err != nil {
			return nil, fmt.Errorf("tensor %q: %w", t.Name, err)
		}
		info := TensorInfo{Name: t.Name, Dims: t.Dims, Type: t.Type, Offset: off, Size: row}
		for _, d := range t.Dims[1:] {
			info.Size *= d
		}
		infos[i] = info
		off = alignUp(off+info.Size, align)
	}
	cw := &countWriter{w: bufio.NewWriterSize(w, 1<<20)}
	cw.bytes([]byte(Magic))
	cw.u32(3)
	cw.u64(uint64(len(infos)))
	cw.u64(uint64(len(kv)))
	for _, e := range kv {
		cw.str(e.Key)
		cw.u32(uint32(e.Value.Type))
		if err := cw.value(e.Value); err != nil {
			return nil, fmt.Errorf("metadata %s: %w", e.Key, err)
		}
	}
	for _, t := range infos {
		cw.str(t.Name)
		cw.u32(uint32(len(t.Dims)))
		for _, d := range t.Dims {
			cw.u64(d)
		}
		cw.u32(uint32(t.Type))
		cw.u64(t.Offset)
	}
	cw.pad(align)
	start := cw.n
	for i, t := range infos {
		before := cw.n
		if cw.err == nil {
			if err := data(i, cw); err != nil {
				return nil, fmt.Errorf("tensor %q: %w", t.Name, err)
			}
		}
		if cw.err == nil && cw.n-before != t.Size {
			return nil, fmt.Errorf("tensor %q: wrote %d bytes, want %d", t.Name, cw.n-before, t.Size)
		}
		if i+1 < len(infos) {
			for cw.n-start < infos[i+1].Offset && cw.err == nil {
				cw.bytes([]byte{0})
			}
		}
	}
	if cw.err != nil {
		return nil, cw.err
	}
	return infos, cw.w.(*bufio.Writer).Flush()
}

type countWriter struct {
	w   io.Writer
	n   uint64
	err error
	buf [8]byte
}

func (c *countWriter) Write(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	n, err := c.w.Write(p)
	c.n += uint64(n)
	c.err = err
	return n, err
}

func (c *countWriter) bytes(b []byte) { c.Write(b) }
func (c *countWriter) u8(x uint8)     { c.bytes([]byte{x}) }
func (c *countWriter) u16(x uint16)   { binary.LittleEndian.PutUint16(c.buf[:], x); c.bytes(c.buf[:2]) }
func (c *countWriter) u32(x uint32)   { binary.LittleEndian.PutUint32(c.buf[:], x); c.bytes(c.buf[:4]) }
func (c *countWriter) u64(x uint64)   { binary.LittleEndian.PutUint64(c.buf[:], x); c.bytes(c.buf[:8]) }
func (c *countWriter) str(s string)   { c.u64(uint64(len(s))); c.bytes([]byte(s)) }

func (c *countWriter) pad(align uint64) {
	for c.n%align != 0 && c.err == nil {
		c.u8(0)
	}
}

func (c *countWriter) scalar(t ValueType, i int64, u uint64, f float64) {
	switch t {
	case TypeUint8, TypeInt8:
		c.u8(uint8(i))
	case TypeUint16, TypeInt16:
		c.u16(uint16(i))
	case TypeUint32, TypeInt32:
		c.u32(uint32(i))
	case TypeInt64:
		c.u64(uint64(i))
	case TypeUint64:
		c.u64(u)
	case TypeFloat32:
		c.u32(math.Float32bits(float32(f)))
	case TypeFloat64:
		c.u64(math.Float64bits(f))
	}
}

func (c *countWriter) value(v Value) error {
	switch v.Type {
	case TypeString:
		s, _ := v.Str()
		c.str(s)
	case TypeBool:
		b, _ := v.BoolValue()
		if b {
			c.u8(1)
		} else {
			c.u8(0)
		}
	case TypeArray:
		c.u32(uint32(v.Elem))
		c.u64(uint64(v.Len()))
		switch x := v.v.(type) {
		case []string:
			for _, s := range x {
				c.str(s)
			}
		case []bool:
			for _, b := range x {
				c.value(Bool(b))
			}
		case []float64:
			for _, f := range x {
				c.scalar(v.Elem, 0, 0, f)
			}
		case []int64:
			for _, i := range x {
				c.scalar(v.Elem, i, 0, 0)
			}
		case []uint64:
			for _, u := range x {
				c.u64(u)
			}
		case []Value:
			for _, e := range x {
				if err := c.value(e); err != nil {
					return err
				}
			}
		default:
			return fmt.Errorf("array of %s holds %T", v.Elem, v.v)
		}
	default:
		if v.Type.fixedSize() == 0 {
			return fmt.Errorf("unknown value type %s", v.Type)
		}
		i, _ := v.Int()
		u, _ := v.Uint()
		f, _ := v.Float()
		c.scalar(v.Type, i, u, f)
	}
	return c.err
}
