//go:build darwin || linux || openbsd

package relay

import (
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// fastWriter makes one non-blocking writev of a frame on a TCP socket: the
// socket takes what fits in its buffer now, and the caller never waits.
// Used under wsConn.wmu only.
type fastWriter struct {
	rc         syscall.RawConn
	f          func(fd uintptr) bool // made once: no closure per frame
	head, body []byte
	n          int
	called     bool
	err        error
}

var errWouldBlock error = unix.EAGAIN

func newFastWriter(tc *net.TCPConn) *fastWriter {
	rc, err := tc.SyscallConn()
	if err != nil {
		return nil
	}
	w := &fastWriter{rc: rc}
	w.f = func(fd uintptr) bool {
		w.called = true
		for {
			n, err := unix.Writev(int(fd), [][]byte{w.head, w.body})
			if err == unix.EINTR {
				continue
			}
			w.n, w.err = max(n, 0), err
			return true // one try: a full socket is left to the writer goroutine
		}
	}
	return w
}

// write reports the bytes written, whether the socket was tried at all (a
// closed socket or a lapsed write deadline is not), and the error
// (errWouldBlock: the socket's buffer is full).
func (w *fastWriter) write(head, body []byte) (n int, called bool, err error) {
	w.head, w.body, w.n, w.called, w.err = head, body, 0, false, nil
	err = w.rc.Write(w.f)
	if err == nil {
		err = w.err
	}
	n, called = w.n, w.called
	w.head, w.body = nil, nil
	return n, called, err
}
