package hopmux

import (
	"io"
	"net"
)

// A frame's head and payload go out in one system call, through connection
// wrappers too. net.Buffers.WriteTo uses writev only on the net package's
// own connections; a wrapper (the node's TLS-or-plain sniffer, a byte
// counter) would otherwise turn one frame into two writes, and on loopback
// into two segments the receiver may wake for separately.

// BuffersWriter is a connection wrapper that can still write several
// buffers at once (usually by handing them to the connection it wraps,
// through WriteBuffers).
type BuffersWriter interface {
	WriteBuffers(bufs *net.Buffers) (int64, error)
}

// WriteBuffers writes bufs to w in order (consuming them): one writev where
// w is a net connection or a BuffersWriter, else one Write per buffer.
func WriteBuffers(w io.Writer, bufs *net.Buffers) (int64, error) {
	if bw, ok := w.(BuffersWriter); ok {
		return bw.WriteBuffers(bufs)
	}
	return bufs.WriteTo(w)
}

// Writev is the buffer list of one head-and-payload write, kept by whoever
// writes a connection (under its write lock) and reused frame after frame,
// so no list is allocated per frame. The zero value is ready.
type Writev struct {
	bufs [2][]byte
	nb   net.Buffers
}

// Write writes head then payload to w with WriteBuffers.
func (f *Writev) Write(w io.Writer, head, payload []byte) (int64, error) {
	f.bufs = [2][]byte{head, payload}
	f.nb = f.bufs[:]
	n, err := WriteBuffers(w, &f.nb)
	f.bufs, f.nb = [2][]byte{}, nil // hold no frame's bytes past the write
	return n, err
}
