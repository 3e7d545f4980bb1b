package bench

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"time"
)

// TCPEcho is the raw-loopback baseline every hop suite is measured against: a
// server that reads a length-prefixed payload and writes it back, over one
// kept-alive TCP connection.
type TCPEcho struct {
	ln   net.Listener
	done chan struct{}
}

// StartTCPEcho listens on 127.0.0.1 and serves until Close.
func StartTCPEcho() (*TCPEcho, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	return startEcho(ln), nil
}

// startEcho serves on ln (a TLS listener for the hops suite's TLS link).
func startEcho(ln net.Listener) *TCPEcho {
	e := &TCPEcho{ln: ln, done: make(chan struct{})}
	go e.serve()
	return e
}

func (e *TCPEcho) serve() {
	defer close(e.done)
	for {
		c, err := e.ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			var hdr [4]byte
			buf := make([]byte, 0, 64<<10)
			var out []byte // reused: the baseline allocates nothing per message
			for {
				c.SetDeadline(time.Now().Add(30 * time.Second))
				if _, err := io.ReadFull(c, hdr[:]); err != nil {
					return
				}
				n := binary.BigEndian.Uint32(hdr[:])
				if n > 64<<20 {
					return
				}
				if cap(buf) < int(n) {
					buf = make([]byte, n)
				}
				buf = buf[:n]
				if _, err := io.ReadFull(c, buf); err != nil {
					return
				}
				out = append(append(out[:0], hdr[:]...), buf...)
				if _, err := c.Write(out); err != nil {
					return
				}
			}
		}()
	}
}

// Addr is the echo server's address.
func (e *TCPEcho) Addr() string { return e.ln.Addr().String() }

// Close stops accepting; connections end when their clients close.
func (e *TCPEcho) Close() error {
	err := e.ln.Close()
	<-e.done
	return err
}

// TCPRoundTrips measures n round trips of payload bytes to the echo server
// and returns each one's duration in microseconds.
func TCPRoundTrips(ctx context.Context, addr string, payload, n int) ([]float64, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	msg := make([]byte, 4+payload)
	binary.BigEndian.PutUint32(msg, uint32(payload))
	back := make([]byte, 4+payload)
	out := make([]float64, 0, n)
	for i := 0; i < n; i++ {
		if err := ctx.Err(); err != nil {
			return out, err
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		t0 := time.Now()
		if _, err := c.Write(msg); err != nil {
			return out, err
		}
		if _, err := io.ReadFull(c, back); err != nil {
			return out, fmt.Errorf("tcp echo: %w", err)
		}
		out = append(out, float64(time.Since(t0).Nanoseconds())/1e3)
	}
	return out, nil
}
