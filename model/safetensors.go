package model

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"sort"
)

// safetensors layout: an 8-byte little-endian header length N, N bytes of
// JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
// {string: string}}, then the data; offsets are relative to the data start.

// maxHeaderBytes caps the JSON header so a hostile length cannot make us
// allocate gigabytes; real headers are well under 1 MiB.
const maxHeaderBytes = 100 << 20

// tensorEntry is one tensor of a parsed header.
type tensorEntry struct {
	DType      DType
	Shape      []int
	Begin, End int64 // byte offsets relative to the data section
}

// header is a parsed and validated safetensors header.
type header struct {
	dataStart int64 // 8 + header length
	tensors   map[string]tensorEntry
	metadata  map[string]string
}

// readHeaderLen reads the length prefix and checks it against the file size.
func readHeaderLen(prefix []byte, fileSize int64) (int64, error) {
	if fileSize < 8 || len(prefix) < 8 {
		return 0, fmt.Errorf("file is %d bytes, too short for a safetensors header (truncated?)", fileSize)
	}
	n := binary.LittleEndian.Uint64(prefix)
	if n > maxHeaderBytes {
		return 0, fmt.Errorf("header length %d is larger than the %d-byte limit (not a safetensors file?)", n, maxHeaderBytes)
	}
	if int64(n) > fileSize-8 {
		return 0, fmt.Errorf("header length %d runs past the end of the %d-byte file (truncated?)", n, fileSize)
	}
	if n < 2 {
		return 0, fmt.Errorf("header length %d is too short for a JSON object", n)
	}
	return int64(n), nil
}

// parseHeader parses and validates the JSON header; dataLen is the number of
// bytes after the header in the file.
func parseHeader(js []byte, dataLen int64) (*header, error) {
	h := &header{dataStart: 8 + int64(len(js)), tensors: map[string]tensorEntry{}}
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.UseNumber()
	tok, err := dec.Token()
	if err != nil || tok != json.Delim('{') {
		return nil, errors.New("header is not a JSON object")
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, fmt.Errorf("header is not valid JSON: %v", err)
		}
		name, ok := tok.(string)
		if !ok {
			return nil, errors.New("header is not valid JSON: expected a tensor name")
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, fmt.Errorf("header is not valid JSON at %q: %v", truncate(name, 80), err)
		}
		if name == "__metadata__" {
			if h.metadata != nil {
				return nil, errors.New("header has __metadata__ twice")
			}
			h.metadata = map[string]string{}
			if err := json.Unmarshal(raw, &h.metadata); err != nil {
				return nil, fmt.Errorf("header __metadata__ must map strings to strings: %v", err)
			}
			continue
		}
		if name == "" {
			return nil, errors.New("header has a tensor with an empty name")
		}
		if _, dup := h.tensors[name]; dup {
			return nil, fmt.Errorf("header names tensor %q twice", truncate(name, 80))
		}
		e, err := parseEntry(raw, dataLen)
		if err != nil {
			return nil, fmt.Errorf("tensor %q: %w", truncate(name, 80), err)
		}
		h.tensors[name] = e
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return nil, fmt.Errorf("header is not valid JSON: %v", err)
	}
	// Only whitespace (the writers' padding) may follow the object.
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("header has data after its JSON object")
	}
	if err := checkOverlaps(h.tensors); err != nil {
		return nil, err
	}
	return h, nil
}

func parseEntry(raw json.RawMessage, dataLen int64) (tensorEntry, error) {
	var r struct {
		DType       *string       `json:"dtype"`
		Shape       []json.Number `json:"shape"`
		DataOffsets []json.Number `json:"data_offsets"`
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&r); err != nil {
		return tensorEntry{}, fmt.Errorf("not a {dtype, shape, data_offsets} object: %v", err)
	}
	if r.DType == nil {
		return tensorEntry{}, errors.New("missing dtype")
	}
	if r.Shape == nil {
		return tensorEntry{}, errors.New("missing shape")
	}
	d := DType(*r.DType)
	if d.Size() == 0 {
		return tensorEntry{}, fmt.Errorf("unknown dtype %q", truncate(*r.DType, 20))
	}
	e := tensorEntry{DType: d, Shape: make([]int, len(r.Shape))}
	if len(r.Shape) > 16 {
		return tensorEntry{}, fmt.Errorf("shape has %d dimensions, more than 16", len(r.Shape))
	}
	elems := int64(1)
	for i, n := range r.Shape {
		v, err := n.Int64()
		if err != nil || v < 0 {
			return tensorEntry{}, fmt.Errorf("shape dimension %s is not a non-negative integer", n)
		}
		// Bound the element count by the data size as we go, so the product
		// cannot overflow.
		if v > 0 && elems > math.MaxInt64/v {
			return tensorEntry{}, fmt.Errorf("shape %v is too large", r.Shape)
		}
		elems *= v
		e.Shape[i] = int(v)
	}
	if len(r.DataOffsets) != 2 {
		return tensorEntry{}, fmt.Errorf("data_offsets must be [begin, end], got %d numbers", len(r.DataOffsets))
	}
	var err1, err2 error
	e.Begin, err1 = r.DataOffsets[0].Int64()
	e.End, err2 = r.DataOffsets[1].Int64()
	if err1 != nil || err2 != nil || e.Begin < 0 || e.End < e.Begin {
		return tensorEntry{}, fmt.Errorf("data_offsets [%s, %s] are not 0 <= begin <= end", r.DataOffsets[0], r.DataOffsets[1])
	}
	if e.End > dataLen {
		return tensorEntry{}, fmt.Errorf("data_offsets [%d, %d] run past the %d data bytes of the file (truncated?)", e.Begin, e.End, dataLen)
	}
	if elems > math.MaxInt64/int64(d.Size()) || elems*int64(d.Size()) != e.End-e.Begin {
		return tensorEntry{}, fmt.Errorf("data_offsets [%d, %d] hold %d bytes but shape %v of %s needs %d x %d", e.Begin, e.End, e.End-e.Begin, e.Shape, d, elems, d.Size())
	}
	return e, nil
}

// checkOverlaps rejects tensors whose byte ranges overlap.
func checkOverlaps(tensors map[string]tensorEntry) error {
	type span struct {
		name       string
		begin, end int64
	}
	spans := make([]span, 0, len(tensors))
	for name, e := range tensors {
		if e.End > e.Begin {
			spans = append(spans, span{name, e.Begin, e.End})
		}
	}
	sort.Slice(spans, func(i, j int) bool {
		if spans[i].begin != spans[j].begin {
			return spans[i].begin < spans[j].begin
		}
		return spans[i].name < spans[j].name
	})
	for i := 1; i < len(spans); i++ {
		if spans[i].begin < spans[i-1].end {
			return fmt.Errorf("tensors %q and %q overlap in the data section", truncate(spans[i-1].name, 80), truncate(spans[i].name, 80))
		}
	}
	return nil
}

// parseImage parses a whole safetensors file held in memory; the fuzz target.
func parseImage(b []byte) (*header, error) {
	n, err := readHeaderLen(b, int64(len(b)))
	if err != nil {
		return nil, err
	}
	return parseHeader(b[8:8+n], int64(len(b))-8-n)
}
