package model

import (
	"bytes"
	"encoding/binary"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// image builds a safetensors file from a literal header and data length.
func image(hdr string, dataLen int) []byte {
	b := make([]byte, 8, 8+len(hdr)+dataLen)
	binary.LittleEndian.PutUint64(b, uint64(len(hdr)))
	b = append(b, hdr...)
	return append(b, make([]byte, dataLen)...)
}

func validImage(t testing.TB) []byte {
	var buf bytes.Buffer
	specs := []WriteSpec{{"w", BF16, []int{2, 3}}, {"b", F32, []int{3}}, {"s", F16, []int{}}}
	err := WriteSafetensors(&buf, specs, map[string]string{"format": "pt"}, func(i int, w io.Writer) error {
		_, err := w.Write(make([]byte, map[int]int{0: 12, 1: 12, 2: 2}[i]))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestParseValidImage(t *testing.T) {
	h, err := parseImage(validImage(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(h.tensors) != 3 || h.metadata["format"] != "pt" || h.tensors["b"].DType != F32 || h.tensors["b"].End-h.tensors["b"].Begin != 12 {
		t.Fatalf("%+v", h)
	}
	if h.dataStart%8 != 0 {
		t.Fatalf("data start %d is not 8-aligned", h.dataStart)
	}
}

func TestParseBadHeaders(t *testing.T) {
	long := make([]byte, 8)
	binary.LittleEndian.PutUint64(long, 1<<40)
	cases := []struct {
		name string
		img  []byte
		want string
	}{
		{"empty file", nil, "too short"},
		{"7 bytes", []byte{1, 2, 3, 4, 5, 6, 7}, "too short"},
		{"huge header length", append(long, '{', '}'), "larger than"},
		{"header past end", image(`{}`, 0)[:9], "runs past the end"},
		{"not JSON", image(`hello world`, 0), "not a JSON object"},
		{"JSON array", image(`[1, 2]`, 0), "not a JSON object"},
		{"unterminated", image(`{"a": {"dtype":"F32","shape":[1],"data_offsets":[0,4]}`, 4), "not valid JSON"},
		{"trailing data", image(`{} {}`, 0), "data after its JSON object"},
		{"unknown dtype", image(`{"a":{"dtype":"F4","shape":[1],"data_offsets":[0,1]}}`, 1), `unknown dtype "F4"`},
		{"negative dim", image(`{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}`, 4), "not a non-negative integer"},
		{"fractional dim", image(`{"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}`, 4), "not a non-negative integer"},
		{"overflowing shape", image(`{"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}}`, 4), "too large"},
		{"offsets past data", image(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, 4), "run past the 4 data bytes"},
		{"offsets reversed", image(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}`, 4), "not 0 <= begin <= end"},
		{"negative offset", image(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}}`, 4), "not 0 <= begin <= end"},
		{"size mismatch", image(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}`, 8), "needs 2 x 4"},
		{"one offset", image(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}}`, 4), "data_offsets must be [begin, end]"},
		{"missing dtype", image(`{"a":{"shape":[1],"data_offsets":[0,4]}}`, 4), "missing dtype"},
		{"missing shape", image(`{"a":{"dtype":"F32","data_offsets":[0,4]}}`, 4), "missing shape"},
		{"overlap", image(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}`, 12), "overlap"},
		{"duplicate name", image(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, 8), "twice"},
		{"empty name", image(`{"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, 4), "empty name"},
		{"metadata not strings", image(`{"__metadata__":{"a":1}}`, 0), "__metadata__"},
		{"entry not object", image(`{"a":[1,2]}`, 0), "not a {dtype, shape, data_offsets} object"},
	}
	for _, tc := range cases {
		_, err := parseImage(tc.img)
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: error %v, want one line with %q", tc.name, err, tc.want)
		}
	}
}

// The bad files, through Open: the error names the file.
func TestOpenBadFiles(t *testing.T) {
	src, _ := synthTiny(t)
	good, err := os.ReadFile(filepath.Join(src, singleFile))
	if err != nil {
		t.Fatal(err)
	}
	n := binary.LittleEndian.Uint64(good)
	lying := bytes.Clone(good)
	// Shift one tensor's end offset: the header now lies about where the data is.
	hdr := string(lying[8 : 8+n])
	i := strings.Index(hdr, `"data_offsets":[0,`)
	if i < 0 {
		t.Fatalf("no tensor at offset 0 in %s", hdr)
	}
	j := i + len(`"data_offsets":[0,`)
	lying[8+j] = '9' // first digit of the end offset
	cases := []struct {
		name string
		data []byte
		want string
	}{
		{"truncated", good[:len(good)/2], "run past the"},
		{"truncated in header", good[:20], "runs past the end"},
		{"lying offsets", lying, "data_offsets"},
	}
	for _, tc := range cases {
		dir := t.TempDir()
		path := filepath.Join(dir, singleFile)
		if err := os.WriteFile(path, tc.data, 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := Open(dir)
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), path) {
			t.Errorf("%s: error %v, want %q naming %s", tc.name, err, tc.want, path)
		}
	}
}

// FuzzParseHeader feeds whole file images to the parser: it must never
// panic, and what it accepts must be consistent.
func FuzzParseHeader(f *testing.F) {
	f.Add(validImage(f))
	f.Add(image(`{}`, 0))
	f.Add(image(`{"__metadata__":{"format":"pt"}}`, 0))
	f.Add(image(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}`, 12))
	f.Add(image(`{"a":{"dtype":"BF16","shape":[0,9007199254740993],"data_offsets":[0,0]}}`, 0))
	f.Add(image(`{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}`, 4))
	f.Add(image(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{}}`, 4))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := parseImage(b)
		if err != nil {
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("multi-line error %q", err)
			}
			return
		}
		dataLen := int64(len(b)) - h.dataStart
		type span struct{ b, e int64 }
		var spans []span
		for name, e := range h.tensors {
			if name == "" || e.Begin < 0 || e.End < e.Begin || e.End > dataLen {
				t.Fatalf("accepted %q with range [%d, %d) of %d", name, e.Begin, e.End, dataLen)
			}
			n := int64(e.DType.Size())
			for _, d := range e.Shape {
				if d < 0 {
					t.Fatalf("accepted negative dim in %q", name)
				}
				n *= int64(d)
			}
			if n != e.End-e.Begin {
				t.Fatalf("accepted %q: %d bytes for shape %v %s", name, e.End-e.Begin, e.Shape, e.DType)
			}
			for _, s := range spans {
				if e.Begin < s.e && s.b < e.End {
					t.Fatalf("accepted overlapping tensors")
				}
			}
			spans = append(spans, span{e.Begin, e.End})
		}
	})
}
