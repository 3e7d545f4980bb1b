package gguf

import (
	"bytes"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Mapped is a GGUF file parsed and mapped read-only. Mapping reads
// nothing: only the pages of the tensors a caller touches are read.
type Mapped struct {
	*File
	Path string
	data []byte
}

// Open parses path's header and maps the file.
func Open(path string) (*Mapped, error) {
	fd, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer fd.Close() // the mapping outlives the descriptor
	st, err := fd.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: not a regular file", path)
	}
	if st.Size() < 24 {
		return nil, fmt.Errorf("%s: %d bytes is too short for a GGUF header (truncated?)", path, st.Size())
	}
	if int64(int(st.Size())) != st.Size() {
		return nil, fmt.Errorf("%s: %d bytes do not fit the address space", path, st.Size())
	}
	data, err := unix.Mmap(int(fd.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("%s: mmap: %w", path, err)
	}
	f, err := Parse(bytes.NewReader(data), st.Size())
	if err != nil {
		unix.Munmap(data)
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &Mapped{File: f, Path: path, data: data}, nil
}

// Data is the tensor's bytes, aliasing the mapping (valid until Close;
// never to be written), and the whole pages they lie in, for madvise.
func (m *Mapped) Data(t TensorInfo) (data, pages []byte) {
	begin := uint64(m.DataOffset) + t.Offset
	end := begin + t.Size
	page := uint64(os.Getpagesize())
	return m.data[begin:end:end], m.data[begin/page*page : end]
}

// Close unmaps the file.
func (m *Mapped) Close() error {
	if m.data == nil {
		return nil
	}
	err := unix.Munmap(m.data)
	m.data = nil
	return err
}
