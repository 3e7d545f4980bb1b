package gguf

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"sort"
	"unicode/utf8"
)

// Magic is the first four bytes of every GGUF file.
const Magic = "GGUF"

// DefaultAlignment is the data alignment when general.alignment is absent.
const DefaultAlignment = 32

// Limits on what one header may declare. Real files are far below them
// (Llama 3's vocab is 128,256 tokens and 280,147 merges); each count is
// also checked against the bytes left in the file before it is allocated.
const (
	maxKVs        = 1 << 16
	maxTensors    = 1 << 20
	maxArrayLen   = 1 << 24
	maxStringLen  = 64 << 20
	maxNameLen    = 1 << 10
	maxDims       = 4 // GGML_MAX_DIMS
	maxArrayDepth = 4
	// preallocLimit caps what a count may reserve before its elements are
	// read: counts are checked against the size the file claims, which a
	// prefix fetched from a server does not prove, so beyond this slices
	// grow only with bytes actually read.
	preallocLimit = 4096
)

// ErrTruncated is wrapped by errors for a header that ends before its
// last field: a truncated file, or a prefix too short to hold the header.
var ErrTruncated = errors.New("truncated")

// TensorInfo is one tensor's entry in the header.
type TensorInfo struct {
	Name string
	// Dims are ggml's ne: Dims[0] is the row length (the fastest-varying
	// index), the reverse of the row-major shape PyTorch and safetensors use.
	Dims   []uint64
	Type   Type
	Offset uint64 // from the start of the data section
	Size   uint64 // bytes
}

// Elements is the product of the dims.
func (t TensorInfo) Elements() uint64 {
	n := uint64(1)
	for _, d := range t.Dims {
		n *= d
	}
	return n
}

// Shape is the row-major shape: Dims reversed.
func (t TensorInfo) Shape() []int {
	s := make([]int, len(t.Dims))
	for i, d := range t.Dims {
		s[len(t.Dims)-1-i] = int(d)
	}
	return s
}

// File is a parsed GGUF header.
type File struct {
	Version   uint32
	KV        []KV // in file order
	Tensors   []TensorInfo
	Alignment uint64
	// DataOffset is where the data section starts in the file; Size is the
	// file size the tensors were checked against.
	DataOffset int64
	Size       int64

	kv      map[string]int
	tensors map[string]int
}

// Get returns the value of a metadata key.
func (f *File) Get(key string) (Value, bool) {
	i, ok := f.kv[key]
	if !ok {
		return Value{}, false
	}
	return f.KV[i].Value, true
}

// Tensor returns the info of the named tensor.
func (f *File) Tensor(name string) (TensorInfo, bool) {
	i, ok := f.tensors[name]
	if !ok {
		return TensorInfo{}, false
	}
	return f.Tensors[i], true
}

// Parse reads a GGUF header from r, which starts at the file's first byte.
// size is the size of the whole file: tensor data must lie within it. r may
// hold less than the whole file (a prefix fetched by a ranged request);
// when it ends inside the header the error wraps ErrTruncated.
func Parse(r io.Reader, size int64) (*File, error) {
	p := &parser{r: bufio.NewReaderSize(r, 64<<10), size: size}
	f, err := p.file()
	if err != nil {
		return nil, err
	}
	return f, nil
}

type parser struct {
	r    *bufio.Reader
	pos  int64 // bytes consumed
	size int64
	err  error
}

// remaining is how many bytes the file has past the read position.
func (p *parser) remaining() int64 {
	if p.size < p.pos {
		return 0
	}
	return p.size - p.pos
}

func (p *parser) read(n int) []byte {
	if p.err != nil {
		return nil
	}
	if int64(n) > p.remaining() {
		p.err = fmt.Errorf("at byte %d: the file ends %d bytes into a %d-byte field (%w)", p.pos, p.remaining(), n, ErrTruncated)
		return nil
	}
	b, err := p.r.Peek(n)
	if err != nil {
		p.err = fmt.Errorf("at byte %d: %d-byte field: %w (%w)", p.pos, n, err, ErrTruncated)
		return nil
	}
	p.r.Discard(n)
	p.pos += int64(n)
	return b
}

func (p *parser) u32() uint32 {
	if b := p.read(4); b != nil {
		return binary.LittleEndian.Uint32(b)
	}
	return 0
}

func (p *parser) u64() uint64 {
	if b := p.read(8); b != nil {
		return binary.LittleEndian.Uint64(b)
	}
	return 0
}

func (p *parser) fail(format string, args ...any) {
	if p.err == nil {
		p.err = fmt.Errorf("at byte %d: "+format, append([]any{p.pos}, args...)...)
	}
}

// count reads a count of items each at least minSize bytes long and checks
// it against limit and the bytes left.
func (p *parser) count(what string, limit uint64, minSize int64) uint64 {
	n := p.u64()
	if p.err != nil {
		return 0
	}
	if n > limit {
		p.fail("%s count %d is over the limit of %d", what, n, limit)
		return 0
	}
	if minSize > 0 && int64(n) > p.remaining()/minSize {
		p.fail("%s count %d needs at least %d bytes, but only %d remain (%w)", what, n, int64(n)*minSize, p.remaining(), ErrTruncated)
		return 0
	}
	return n
}

func (p *parser) str(what string, limit uint64) string {
	n := p.u64()
	if p.err != nil {
		return ""
	}
	if n > limit {
		p.fail("%s is %d bytes, over the limit of %d", what, n, limit)
		return ""
	}
	if int64(n) > p.remaining() {
		p.fail("%s of %d bytes runs past the end of the file (%w)", what, n, ErrTruncated)
		return ""
	}
	// Peek is bounded by the buffer, so long strings are read in pieces.
	buf := make([]byte, 0, min(n, preallocLimit))
	for uint64(len(buf)) < n && p.err == nil {
		chunk := min(int(n)-len(buf), p.r.Size())
		buf = append(buf, p.read(chunk)...)
	}
	return string(buf)
}

func (p *parser) file() (*File, error) {
	if b := p.read(4); b != nil && string(b) != Magic {
		return nil, fmt.Errorf("not a GGUF file: it starts with %q, not %q", b, Magic)
	}
	f := &File{Version: p.u32(), Size: p.size, kv: map[string]int{}, tensors: map[string]int{}}
	if p.err != nil {
		return nil, p.err
	}
	switch f.Version {
	case 2, 3:
	case 1:
		return nil, errors.New("GGUF version 1 is not supported (it predates 64-bit counts; convert the file again with a current llama.cpp)")
	default:
		if f.Version>>24 != 0 && f.Version&0xff == 0 {
			return nil, fmt.Errorf("GGUF version %#x looks big-endian; only little-endian files are supported", f.Version)
		}
		return nil, fmt.Errorf("GGUF version %d is not supported (want 2 or 3)", f.Version)
	}
	// A tensor info is at least 8 (name) + 4 + 8 (one dim) + 4 + 8 bytes;
	// a key/value at least 8 + 4 + 1.
	nTensors := p.count("tensor", maxTensors, 32)
	nKV := p.count("metadata key/value", maxKVs, 13)
	for i := uint64(0); i < nKV && p.err == nil; i++ {
		key := p.str("a metadata key", maxNameLen)
		if p.err == nil && !utf8.ValidString(key) {
			p.fail("metadata key %q is not valid UTF-8", key)
		}
		if _, dup := f.kv[key]; dup && p.err == nil {
			p.fail("metadata key %q appears twice", key)
		}
		v := p.value(ValueType(p.u32()), key, 0)
		if p.err != nil {
			break
		}
		f.kv[key] = len(f.KV)
		f.KV = append(f.KV, KV{Key: key, Value: v})
	}
	if p.err != nil {
		return nil, p.err
	}
	f.Alignment = DefaultAlignment
	if v, ok := f.Get("general.alignment"); ok {
		a, isInt := v.Uint()
		if !isInt || v.Type != TypeUint32 || a == 0 || a&(a-1) != 0 || a > 1<<20 {
			return nil, fmt.Errorf("general.alignment is %s (%s); it must be a uint32 power of two", v, v.Type)
		}
		f.Alignment = a
	}
	f.Tensors = make([]TensorInfo, 0, min(nTensors, preallocLimit))
	for i := uint64(0); i < nTensors && p.err == nil; i++ {
		t := p.tensorInfo()
		if p.err != nil {
			break
		}
		if _, dup := f.tensors[t.Name]; dup {
			return nil, fmt.Errorf("tensor %q appears twice", t.Name)
		}
		f.tensors[t.Name] = len(f.Tensors)
		f.Tensors = append(f.Tensors, t)
	}
	if p.err != nil {
		return nil, p.err
	}
	f.DataOffset = int64(alignUp(uint64(p.pos), f.Alignment))
	if err := f.checkData(); err != nil {
		return nil, err
	}
	return f, nil
}

func (p *parser) value(t ValueType, key string, depth int) Value {
	if p.err != nil {
		return Value{}
	}
	switch t {
	case TypeUint8:
		if b := p.read(1); b != nil {
			return Uint8(b[0])
		}
	case TypeInt8:
		if b := p.read(1); b != nil {
			return Int8(int8(b[0]))
		}
	case TypeBool:
		if b := p.read(1); b != nil {
			if b[0] > 1 {
				p.fail("%s: bool byte is %d, not 0 or 1", key, b[0])
			}
			return Bool(b[0] == 1)
		}
	case TypeUint16:
		if b := p.read(2); b != nil {
			return Uint16(binary.LittleEndian.Uint16(b))
		}
	case TypeInt16:
		if b := p.read(2); b != nil {
			return Int16(int16(binary.LittleEndian.Uint16(b)))
		}
	case TypeUint32:
		return Uint32(p.u32())
	case TypeInt32:
		return Int32(int32(p.u32()))
	case TypeFloat32:
		return Float32(math.Float32frombits(p.u32()))
	case TypeUint64:
		return Uint64(p.u64())
	case TypeInt64:
		return Int64(int64(p.u64()))
	case TypeFloat64:
		return Float64(math.Float64frombits(p.u64()))
	case TypeString:
		return String(p.str(key, maxStringLen))
	case TypeArray:
		return p.array(key, depth)
	default:
		p.fail("%s: unknown metadata value type %d", key, uint32(t))
	}
	return Value{}
}

func (p *parser) array(key string, depth int) Value {
	if depth >= maxArrayDepth {
		p.fail("%s: arrays nested more than %d deep", key, maxArrayDepth)
		return Value{}
	}
	elem := ValueType(p.u32())
	minSize := int64(elem.fixedSize())
	switch elem {
	case TypeString:
		minSize = 8
	case TypeArray:
		minSize = 12
	default:
		if minSize == 0 && p.err == nil {
			p.fail("%s: unknown array element type %d", key, uint32(elem))
			return Value{}
		}
	}
	n := int(p.count(key+" array", maxArrayLen, minSize))
	if p.err != nil {
		return Value{}
	}
	switch elem {
	case TypeString:
		return Strings(readArray(p, n, func() string { return p.str(key+" element", maxStringLen) }))
	case TypeBool:
		return Bools(readArray(p, n, func() bool { b, _ := p.value(elem, key, depth).BoolValue(); return b }))
	case TypeFloat32, TypeFloat64:
		return Floats(elem, readArray(p, n, func() float64 { f, _ := p.value(elem, key, depth).Float(); return f }))
	case TypeUint64:
		return Value{Type: TypeArray, Elem: elem, v: readArray(p, n, p.u64)}
	case TypeArray:
		return Arrays(readArray(p, n, func() Value { return p.array(key, depth+1) }))
	default:
		return Ints(elem, readArray(p, n, func() int64 { i, _ := p.value(elem, key, depth).Int(); return i }))
	}
}

// readArray reads n elements, stopping at the first error; the slice grows
// with what was read (see preallocLimit).
func readArray[T any](p *parser, n int, next func() T) []T {
	s := make([]T, 0, min(n, preallocLimit))
	for i := 0; i < n && p.err == nil; i++ {
		s = append(s, next())
	}
	return s
}

func (p *parser) tensorInfo() TensorInfo {
	t := TensorInfo{Name: p.str("a tensor name", maxNameLen)}
	if p.err != nil {
		return t
	}
	if t.Name == "" || !utf8.ValidString(t.Name) {
		p.fail("tensor name %q is empty or not valid UTF-8", t.Name)
		return t
	}
	nd := p.u32()
	if p.err == nil && (nd == 0 || nd > maxDims) {
		p.fail("tensor %q has %d dimensions (want 1 to %d)", t.Name, nd, maxDims)
		return t
	}
	elems := uint64(1)
	for i := uint32(0); i < nd && p.err == nil; i++ {
		d := p.u64()
		if p.err == nil && (d == 0 || d > 1<<40 || elems > math.MaxInt64/d) {
			p.fail("tensor %q: dimension %d is %d (zero, or the element count overflows)", t.Name, i, d)
		}
		elems *= max(d, 1)
		t.Dims = append(t.Dims, d)
	}
	t.Type = Type(p.u32())
	t.Offset = p.u64()
	if p.err != nil {
		return t
	}
	if !t.Type.Known() {
		p.fail("tensor %q has unknown type %d", t.Name, uint32(t.Type))
		return t
	}
	row, err := t.Type.RowBytes(t.Dims[0])
	if err != nil {
		p.fail("tensor %q: %v", t.Name, err)
		return t
	}
	rows := elems / t.Dims[0]
	if row != 0 && rows > math.MaxInt64/row {
		p.fail("tensor %q: %d rows of %d bytes overflow", t.Name, rows, row)
		return t
	}
	t.Size = row * rows
	return t
}

// checkData checks that every tensor is aligned, lies inside the file and
// overlaps no other.
func (f *File) checkData() error {
	dataLen := uint64(max(f.Size-f.DataOffset, 0))
	order := make([]int, len(f.Tensors))
	for i, t := range f.Tensors {
		order[i] = i
		if t.Offset%f.Alignment != 0 {
			return fmt.Errorf("tensor %q: offset %d is not a multiple of the alignment %d", t.Name, t.Offset, f.Alignment)
		}
		if t.Offset > dataLen || t.Size > dataLen-t.Offset {
			return fmt.Errorf("tensor %q: its %d bytes at data offset %d run past the end of the file (data section is %d bytes; truncated?)", t.Name, t.Size, t.Offset, dataLen)
		}
	}
	sort.Slice(order, func(a, b int) bool { return f.Tensors[order[a]].Offset < f.Tensors[order[b]].Offset })
	for i := 1; i < len(order); i++ {
		a, b := f.Tensors[order[i-1]], f.Tensors[order[i]]
		if a.Offset+a.Size > b.Offset {
			return fmt.Errorf("tensors %q and %q overlap in the file", a.Name, b.Name)
		}
	}
	return nil
}

func alignUp(x, a uint64) uint64 { return (x + a - 1) / a * a }
