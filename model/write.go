package model

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"os"
)

// WriteSpec describes a tensor to write.
type WriteSpec struct {
	Name  string
	DType DType
	Shape []int
}

func (s WriteSpec) bytes() int64 {
	n := int64(s.DType.Size())
	for _, d := range s.Shape {
		n *= int64(d)
	}
	return n
}

// WriteSafetensors streams a safetensors file to w: the header for specs
// (data in spec order), then each tensor's bytes as fill(i, w) writes them.
// fill must write exactly the tensor's size; the header is padded with
// spaces to 8 bytes so the data stays aligned, as the reference writer does.
func WriteSafetensors(w io.Writer, specs []WriteSpec, metadata map[string]string, fill func(i int, w io.Writer) error) error {
	type entry struct {
		DType       DType    `json:"dtype"`
		Shape       []int    `json:"shape"`
		DataOffsets [2]int64 `json:"data_offsets"`
	}
	hdr := make(map[string]any, len(specs)+1)
	if len(metadata) > 0 {
		hdr["__metadata__"] = metadata
	}
	var off int64
	for _, s := range specs {
		if s.DType.Size() == 0 {
			return fmt.Errorf("tensor %q: unknown dtype %q", s.Name, s.DType)
		}
		if _, dup := hdr[s.Name]; dup || s.Name == "" {
			return fmt.Errorf("tensor name %q is empty or repeated", s.Name)
		}
		shape := s.Shape
		if shape == nil {
			shape = []int{}
		}
		hdr[s.Name] = entry{s.DType, shape, [2]int64{off, off + s.bytes()}}
		off += s.bytes()
	}
	js, err := json.Marshal(hdr)
	if err != nil {
		return err
	}
	for len(js)%8 != 0 {
		js = append(js, ' ')
	}
	var prefix [8]byte
	binary.LittleEndian.PutUint64(prefix[:], uint64(len(js)))
	if _, err := w.Write(prefix[:]); err != nil {
		return err
	}
	if _, err := w.Write(js); err != nil {
		return err
	}
	for i, s := range specs {
		cw := &countingWriter{w: w}
		if err := fill(i, cw); err != nil {
			return fmt.Errorf("tensor %q: %w", s.Name, err)
		}
		if cw.n != s.bytes() {
			return fmt.Errorf("tensor %q: wrote %d bytes, want %d", s.Name, cw.n, s.bytes())
		}
	}
	return nil
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// WriteSafetensorsFile writes in-memory tensors to path, e.g. for tests.
func WriteSafetensorsFile(path string, tensors []Tensor, metadata map[string]string) error {
	specs := make([]WriteSpec, len(tensors))
	for i, t := range tensors {
		specs[i] = WriteSpec{t.Name, t.DType, t.Shape}
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	bw := bufio.NewWriterSize(f, 1<<20)
	err = WriteSafetensors(bw, specs, metadata, func(i int, w io.Writer) error {
		_, err := w.Write(tensors[i].Data)
		return err
	})
	if err == nil {
		err = bw.Flush()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}
