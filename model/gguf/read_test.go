package gguf

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math"
	"reflect"
	"runtime"
	"strings"
	"testing"
)

// raw builds GGUF bytes field by field, independently of Write, so a test
// can make any broken file.
type raw struct{ bytes.Buffer }

func (r *raw) u8(x uint8) *raw   { r.WriteByte(x); return r }
func (r *raw) u32(x uint32) *raw { binary.Write(&r.Buffer, binary.LittleEndian, x); return r }
func (r *raw) u64(x uint64) *raw { binary.Write(&r.Buffer, binary.LittleEndian, x); return r }
func (r *raw) str(s string) *raw { r.u64(uint64(len(s))); r.WriteString(s); return r }
func (r *raw) head(version uint32, tensors, kvs uint64) *raw {
	r.WriteString(Magic)
	return r.u32(version).u64(tensors).u64(kvs)
}

// tensor writes a tensor info.
func (r *raw) tensor(name string, typ Type, offset uint64, dims ...uint64) *raw {
	r.str(name).u32(uint32(len(dims)))
	for _, d := range dims {
		r.u64(d)
	}
	return r.u32(uint32(typ)).u64(offset)
}

// pad aligns to 32 and appends n data bytes.
func (r *raw) data(n int) []byte {
	for r.Len()%32 != 0 {
		r.u8(0)
	}
	r.Write(make([]byte, n))
	return r.Bytes()
}

func parseBytes(b []byte) (*File, error) { return Parse(bytes.NewReader(b), int64(len(b))) }

// sampleKV has a value of every type, nested arrays included.
func sampleKV() []KV {
	return []KV{
		{"general.architecture", String("llama")},
		{"u8", Uint8(200)}, {"i8", Int8(-100)}, {"u16", Uint16(60000)}, {"i16", Int16(-30000)},
		{"u32", Uint32(4e9)}, {"i32", Int32(-2e9)}, {"u64", Uint64(1 << 63)}, {"i64", Int64(-1 << 62)},
		{"f32", Float32(1.5)}, {"f64", Float64(math.Pi)}, {"bool", Bool(true)},
		{"strings", Strings([]string{"a", "", "ünïcode"})},
		{"i32s", Ints(TypeInt32, []int64{-1, 2, 3})}, {"u8s", Ints(TypeUint8, []int64{1, 255})},
		{"f32s", Floats(TypeFloat32, []float64{0.5, -2})}, {"bools", Bools([]bool{true, false})},
		{"u64s", Value{Type: TypeArray, Elem: TypeUint64, v: []uint64{1 << 60}}},
		{"nested", Arrays([]Value{Strings([]string{"x"}), Ints(TypeInt16, []int64{7})})},
	}
}

func sampleFile(t *testing.T) []byte {
	var buf bytes.Buffer
	tensors := []WriteTensor{
		{Name: "a", Dims: []uint64{3}, Type: F32},
		{Name: "q", Dims: []uint64{256, 2}, Type: Q4_K},
		{Name: "b", Dims: []uint64{64, 2}, Type: Q8_0},
	}
	_, err := Write(&buf, sampleKV(), tensors, func(i int, w io.Writer) error {
		sizes := []int{12, 288, 136}
		_, err := w.Write(bytes.Repeat([]byte{byte(i + 1)}, sizes[i]))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestRoundTrip(t *testing.T) {
	b := sampleFile(t)
	f, err := parseBytes(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(f.KV, sampleKV()) {
		t.Fatalf("metadata differs:\n%v\n%v", f.KV, sampleKV())
	}
	want := []struct {
		name      string
		off, size uint64
		shape     []int
	}{{"a", 0, 12, []int{3}}, {"q", 32, 288, []int{2, 256}}, {"b", 320, 136, []int{2, 64}}}
	for i, w := range want {
		ti := f.Tensors[i]
		if ti.Name != w.name || ti.Offset != w.off || ti.Size != w.size || !reflect.DeepEqual(ti.Shape(), w.shape) {
			t.Errorf("tensor %d: %+v", i, ti)
		}
		data := b[f.DataOffset+int64(ti.Offset):][:ti.Size]
		if !bytes.Equal(data, bytes.Repeat([]byte{byte(i + 1)}, int(ti.Size))) {
			t.Errorf("tensor %s: data not where the header says", ti.Name)
		}
	}
	if v, _ := f.Get("u64"); func() bool { u, ok := v.Uint(); return !ok || u != 1<<63 }() {
		t.Errorf("u64 getter: %v", v)
	}
	if v, _ := f.Get("i8"); func() bool { i, ok := v.Int(); return !ok || i != -100 }() {
		t.Errorf("i8 getter: %v", v)
	}
}

// Every prefix of a valid file is refused with an error, never a panic;
// cuts inside the header say the file is truncated.
func TestEveryTruncationIsRefused(t *testing.T) {
	b := sampleFile(t)
	f, _ := parseBytes(b)
	for n := 0; n < len(b); n++ {
		_, err := parseBytes(b[:n])
		if err == nil {
			t.Fatalf("a file cut to %d of %d bytes parsed", n, len(b))
		}
		if n >= 4 && n < int(f.DataOffset)-32 && !errors.Is(err, ErrTruncated) {
			t.Fatalf("cut at %d: %v does not say truncated", n, err)
		}
	}
	// A prefix read against the whole file's size is a header that needs
	// more bytes: what a ranged download grows.
	for _, n := range []int{10, 100, int(f.DataOffset) - 40} {
		if _, err := Parse(bytes.NewReader(b[:n]), int64(len(b))); !errors.Is(err, ErrTruncated) {
			t.Fatalf("prefix of %d: %v", n, err)
		}
	}
	if _, err := Parse(bytes.NewReader(b[:f.DataOffset]), int64(len(b))); err != nil {
		t.Fatalf("the header alone against the file size: %v", err)
	}
}

func TestBrokenFiles(t *testing.T) {
	arrHead := func(r *raw, key string, elem ValueType, n uint64) *raw {
		return r.str(key).u32(uint32(TypeArray)).u32(uint32(elem)).u64(n)
	}
	cases := []struct {
		name string
		file func() []byte
		want string
	}{
		{"empty", func() []byte { return nil }, "truncated"},
		{"bad magic", func() []byte { r := &raw{}; r.WriteString("GGML"); return r.u32(3).u64(0).u64(0).Bytes() }, "not a GGUF file"},
		{"version 1", func() []byte { return (&raw{}).head(1, 0, 0).Bytes() }, "version 1 is not supported"},
		{"version 99", func() []byte { return (&raw{}).head(99, 0, 0).Bytes() }, "version 99"},
		{"big-endian", func() []byte { return (&raw{}).head(3<<24, 0, 0).Bytes() }, "big-endian"},
		{"no counts", func() []byte { r := &raw{}; r.WriteString(Magic); return r.u32(3).Bytes() }, "truncated"},
		{"huge tensor count", func() []byte { return (&raw{}).head(3, 1<<40, 0).Bytes() }, "over the limit"},
		{"tensor count past the file", func() []byte { return (&raw{}).head(3, 1000, 0).data(64) }, "only"},
		{"huge kv count", func() []byte { return (&raw{}).head(3, 0, 1<<40).Bytes() }, "over the limit"},
		{"huge key", func() []byte { return (&raw{}).head(3, 0, 1).u64(1 << 50).data(64) }, "over the limit"},
		{"key past the end", func() []byte { return (&raw{}).head(3, 0, 1).u64(500).data(64) }, "past the end"},
		{"invalid utf-8 key", func() []byte { return (&raw{}).head(3, 0, 1).str("\xff\xfe").u32(uint32(TypeUint8)).u8(1).Bytes() }, "UTF-8"},
		{"unknown value type", func() []byte { return (&raw{}).head(3, 0, 1).str("k").u32(77).Bytes() }, "unknown metadata value type 77"},
		{"huge string value", func() []byte { return (&raw{}).head(3, 0, 1).str("k").u32(uint32(TypeString)).u64(1 << 40).Bytes() }, "over the limit"},
		{"unknown array element", func() []byte { return arrHead((&raw{}).head(3, 0, 1), "k", 99, 1).Bytes() }, "unknown array element type 99"},
		{"array past the file", func() []byte { return arrHead((&raw{}).head(3, 0, 1), "k", TypeUint32, 1<<20).data(64) }, "only"},
		{"array of strings past the file", func() []byte { return arrHead((&raw{}).head(3, 0, 1), "k", TypeString, 1<<23).data(64) }, "only"},
		{"huge array", func() []byte { return arrHead((&raw{}).head(3, 0, 1), "k", TypeUint8, 1<<40).Bytes() }, "over the limit"},
		{"arrays nested too deep", func() []byte {
			r := (&raw{}).head(3, 0, 1).str("k").u32(uint32(TypeArray))
			for i := 0; i < 6; i++ {
				r.u32(uint32(TypeArray)).u64(1)
			}
			return r.data(64)
		}, "nested more than"},
		{"bool byte 2", func() []byte { return (&raw{}).head(3, 0, 1).str("k").u32(uint32(TypeBool)).u8(2).Bytes() }, "not 0 or 1"},
		{"duplicate key", func() []byte {
			return (&raw{}).head(3, 0, 2).str("k").u32(uint32(TypeUint8)).u8(1).str("k").u32(uint32(TypeUint8)).u8(1).Bytes()
		}, "appears twice"},
		{"alignment 3", func() []byte {
			return (&raw{}).head(3, 0, 1).str("general.alignment").u32(uint32(TypeUint32)).u32(3).Bytes()
		}, "power of two"},
		{"alignment as string", func() []byte {
			return (&raw{}).head(3, 0, 1).str("general.alignment").u32(uint32(TypeString)).str("32").Bytes()
		}, "power of two"},
		{"zero dims", func() []byte { return (&raw{}).head(3, 1, 0).tensor("t", F32, 0).data(64) }, "0 dimensions"},
		{"five dims", func() []byte { return (&raw{}).head(3, 1, 0).tensor("t", F32, 0, 1, 1, 1, 1, 1).data(64) }, "5 dimensions"},
		{"a zero dim", func() []byte { return (&raw{}).head(3, 1, 0).tensor("t", F32, 0, 4, 0).data(64) }, "dimension 1 is 0"},
		{"element count overflow", func() []byte { return (&raw{}).head(3, 1, 0).tensor("t", F32, 0, 1<<40, 1<<40).data(64) }, "overflows"},
		{"unknown tensor type", func() []byte { return (&raw{}).head(3, 1, 0).tensor("t", 99, 0, 4).data(64) }, "unknown type 99"},
		{"row not whole blocks", func() []byte { return (&raw{}).head(3, 1, 0).tensor("t", Q4_K, 0, 100).data(1024) }, "whole number of Q4_K blocks"},
		{"misaligned offset", func() []byte { return (&raw{}).head(3, 1, 0).tensor("t", F32, 4, 4).data(64) }, "not a multiple of the alignment"},
		{"tensor past the end", func() []byte { return (&raw{}).head(3, 1, 0).tensor("t", F32, 0, 1024).data(64) }, "run past the end"},
		{"offset past the end", func() []byte { return (&raw{}).head(3, 1, 0).tensor("t", F32, 1<<62, 4).data(64) }, "run past the end"},
		{"overlapping tensors", func() []byte {
			return (&raw{}).head(3, 2, 0).tensor("a", F32, 0, 16).tensor("b", F32, 32, 4).data(128)
		}, "overlap"},
		{"duplicate tensor", func() []byte { return (&raw{}).head(3, 2, 0).tensor("a", F32, 0, 4).tensor("a", F32, 32, 4).data(128) }, "appears twice"},
		{"empty tensor name", func() []byte { return (&raw{}).head(3, 1, 0).tensor("", F32, 0, 4).data(64) }, "empty"},
		{"data cut short", func() []byte { b := sampleFile(t); return b[:len(b)-10] }, "past the end"},
	}
	if len(cases) < 20 {
		t.Fatal("fewer than 20 kinds of broken file")
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b := c.file()
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			_, err := parseBytes(b)
			runtime.ReadMemStats(&after)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("want an error containing %q, got %v", c.want, err)
			}
			// Bounded by what the bytes can hold, not by what they claim.
			if got := after.TotalAlloc - before.TotalAlloc; got > 1<<20+64*uint64(len(b)) {
				t.Fatalf("allocated %d bytes for a %d-byte file", got, len(b))
			}
		})
	}
}

// FuzzParse: no input panics, allocates far beyond its size, or parses
// into tensors outside itself. The seed corpus runs in every `go test`.
func FuzzParse(f *testing.F) {
	f.Add([]byte{})
	var buf bytes.Buffer
	Write(&buf, sampleKV(), []WriteTensor{{Name: "a", Dims: []uint64{64, 2}, Type: Q8_0}}, func(i int, w io.Writer) error {
		_, err := w.Write(make([]byte, 136))
		return err
	})
	f.Add(buf.Bytes())
	f.Add((&raw{}).head(3, 1, 1).str("general.alignment").u32(uint32(TypeUint32)).u32(64).tensor("t", BF16, 0, 8, 2).data(64))
	f.Add((&raw{}).head(2, 0, 1).str("k").u32(uint32(TypeArray)).u32(uint32(TypeString)).u64(2).str("x").str("y").Bytes())
	f.Fuzz(func(t *testing.T, b []byte) {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		file, err := parseBytes(b)
		runtime.ReadMemStats(&after)
		if got := after.TotalAlloc - before.TotalAlloc; got > 4<<20+64*uint64(len(b)) {
			t.Fatalf("allocated %d bytes for %d bytes of input", got, len(b))
		}
		if err != nil {
			return
		}
		for _, ti := range file.Tensors {
			if uint64(file.DataOffset)+ti.Offset+ti.Size > uint64(len(b)) {
				t.Fatalf("tensor %q lies outside the input", ti.Name)
			}
		}
	})
}

// A prefix parsed against a size the server claims (a hub download) holds
// far fewer bytes than its counts may declare: what it allocates is bounded
// by the bytes actually read, not by the claimed size.
func TestPrefixAgainstAHugeClaimedSize(t *testing.T) {
	r := (&raw{}).head(3, 0, 1).str("k").u32(uint32(TypeArray))
	for i := 0; i < maxArrayDepth; i++ {
		r.u32(uint32(TypeArray)).u64(maxArrayLen)
	}
	b := r.Bytes()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := Parse(bytes.NewReader(b), 1<<40)
	runtime.ReadMemStats(&after)
	if err == nil {
		t.Fatal("parsed")
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 4<<20 {
		t.Fatalf("allocated %d bytes for a %d-byte prefix", got, len(b))
	}
}
