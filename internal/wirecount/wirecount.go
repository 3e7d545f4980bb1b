// Package wirecount counts the bytes that a dialer's connections read and
// write, for "bytes on the wire per hop" in the hop benchmarks.
package wirecount

import (
	"context"
	"net"
	"sync/atomic"

	"meshgpu/hopmux"
)

// Counter is a dialer whose connections add what they move to one total.
// The zero value is ready to use.
type Counter struct{ n atomic.Int64 }

// Dial has the signature of http.Transport.DialContext.
func (c *Counter) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return countedConn{Conn: conn, c: c}, nil
}

// Bytes is the total read and written since the last Reset.
func (c *Counter) Bytes() int64 { return c.n.Load() }

// Reset sets the total back to zero.
func (c *Counter) Reset() { c.n.Store(0) }

type countedConn struct {
	net.Conn
	c *Counter
}

func (cc countedConn) Read(p []byte) (int, error) {
	n, err := cc.Conn.Read(p)
	cc.c.n.Add(int64(n))
	return n, err
}

func (cc countedConn) Write(p []byte) (int, error) {
	n, err := cc.Conn.Write(p)
	cc.c.n.Add(int64(n))
	return n, err
}

var _ hopmux.BuffersWriter = countedConn{}

// WriteBuffers keeps a frame one writev through the counter (hopmux.BuffersWriter).
func (cc countedConn) WriteBuffers(bufs *net.Buffers) (int64, error) {
	n, err := hopmux.WriteBuffers(cc.Conn, bufs)
	cc.c.n.Add(n)
	return n, err
}
