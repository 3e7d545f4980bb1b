// Package writev writes a frame's head and payload in one system call
// through connection wrappers too.
//
// net.Buffers.WriteTo uses writev only on the net package's own
// connections; a wrapper (the node's TLS-or-plain sniffer, a byte counter)
// would otherwise turn one frame into two writes, and on loopback into two
// segments the receiver may wake for separately.
package writev

import (
	"io"
	"net"
)

// Writer is a connection wrapper that can still write several buffers at
// once (usually by handing them to the connection it wraps).
type Writer interface {
	WriteBuffers(bufs *net.Buffers) (int64, error)
}

// Write writes bufs to w in order: one writev where w is a net connection
// or a Writer, else one Write per buffer.
func Write(w io.Writer, bufs ...[]byte) (int64, error) {
	nb := net.Buffers(bufs)
	if bw, ok := w.(Writer); ok {
		return bw.WriteBuffers(&nb)
	}
	return nb.WriteTo(w)
}
