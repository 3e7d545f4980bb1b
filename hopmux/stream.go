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
	return c.ServeFrames(Frames{Next: func() (io.Reader, error) { return s.R, nil },
		SetReadDeadline: s.Conn.SetReadDeadline, Idle: idle, MaxFrame: s.MaxFrame}, nil, limit)
}

// Frames is a transport's read side, as ServeFrames reads it: the mux
// reads each frame, header and payload, from the reader Next returns.
type Frames struct {
	// Next returns the reader frames are read from: the stream itself, or
	// a WebSocket's next message. It is called for the first frame and,
	// with Messages, again at the end of each message.
	Next func() (io.Reader, error)
	// Messages: io.EOF at a frame boundary ends one message, not the
	// transport.
	Messages bool
	// SetReadDeadline, when set, is moved on to Idle from now before each
	// frame (to within an eighth: package deadline).
	SetReadDeadline func(time.Time) error
	Idle            time.Duration
	// MaxFrame is the largest frame payload read.
	MaxFrame int
}

// ServeFrames is Serve reading frames from f: the mux reads every frame's
// header itself, on every transport.
func (c *Conn) ServeFrames(f Frames, others func(io.Reader, FrameType, int) error, limit int) error {
	var r io.Reader          // the message being read, or the stream
	var readBy deadline.Lazy // the reading goroutine's (one at a time)
	return c.Serve(func() (FrameType, io.Reader, int, error) {
		for {
			if r == nil {
				var err error
				if r, err = f.Next(); err != nil {
					return 0, nil, 0, err
				}
			}
			if f.SetReadDeadline != nil {
				readBy.Extend(f.SetReadDeadline, f.Idle)
			}
			typ, n, err := ReadFrameHeader(r, f.MaxFrame)
			if err == io.EOF && f.Messages {
				r = nil // the end of one message
				continue
			}
			return typ, r, n, err
		}
	}, others, limit)
}
