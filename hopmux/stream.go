package hopmux

import (
	"bufio"
	"io"
	"net"
	"sync"
	"time"

	"meshgpu/internal/deadline"
)

// Stream is the transport of a direct hop connection (GET /hop over TCP or
// TLS, a direct path's QUIC stream): frames read from R, Conn's buffered
// reader, and written whole to Conn, head and payload in one writev, one
// frame at a time. A Conn on a Stream sets Write to the Stream's and runs
// ServeStream, so the mux reads and writes the socket itself.
type Stream struct {
	Conn net.Conn
	R    *bufio.Reader
	// MaxFrame is the largest frame payload read; WriteTimeout bounds one
	// frame write (a peer slower than that is dropped).
	MaxFrame     int
	WriteTimeout time.Duration

	mu      sync.Mutex
	writeBy deadline.Lazy // under mu
	frame   Writev        // under mu
}

// Write is a Conn's Write on s: it writes one frame (body is not copied)
// and then calls done, when set. A failed write closes the connection: a
// frame may be half written, so it cannot be used again.
func (s *Stream) Write(head, body []byte, done func()) error {
	s.mu.Lock()
	s.writeBy.Extend(s.Conn.SetWriteDeadline, s.WriteTimeout)
	var err error
	if len(body) == 0 {
		_, err = s.Conn.Write(head)
	} else {
		_, err = s.frame.Write(s.Conn, head, body)
	}
	s.mu.Unlock()
	if err != nil {
		s.Conn.Close()
	}
	if done != nil {
		done()
	}
	return err
}

// ServeStream is Serve reading frames from s until it fails, a malformed
// frame arrives (the peer's framing can no longer be trusted) or nothing
// comes for idle.
func (c *Conn) ServeStream(s *Stream, idle time.Duration, limit int) error {
	var readBy deadline.Lazy // the reading goroutine's (one at a time)
	return c.Serve(func() (FrameType, io.Reader, int, error) {
		readBy.Extend(s.Conn.SetReadDeadline, idle)
		typ, n, err := ReadFrameHeader(s.R, s.MaxFrame)
		return typ, s.R, n, err
	}, nil, limit)
}
