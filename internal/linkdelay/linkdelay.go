// Package linkdelay emulates a network link's round-trip time on the dialing
// side of loopback connections, for benchmarks that ask what a protocol
// costs over a WAN (the hops suite's --rtt). There is no netem in every
// container, and a user-space delay on the dialer's end is enough for
// request/response protocols: connecting costs one RTT (SYN, SYN-ACK), and
// every byte is held half an RTT on its way out and half on its way in, so
// each wait for an answer costs one RTT. Bandwidth and congestion windows are
// not modelled: hop payloads are a few KiB.
package linkdelay

import (
	"context"
	"net"
	"os"
	"sync"
	"time"
)

// DialFunc has the signature of net.Dialer.DialContext.
type DialFunc func(ctx context.Context, network, addr string) (net.Conn, error)

// Dialer wraps Dial's connections in a link of round-trip time RTT.
type Dialer struct {
	RTT  time.Duration
	Dial DialFunc // nil: a plain net.Dialer
}

// DialContext connects after one RTT (the TCP handshake), then delays both
// directions by RTT/2.
func (d *Dialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	dial := d.Dial
	if dial == nil {
		var nd net.Dialer
		dial = nd.DialContext
	}
	if err := sleepCtx(ctx, d.RTT); err != nil {
		return nil, err
	}
	c, err := dial(ctx, network, addr)
	if err != nil || d.RTT <= 0 {
		return c, err
	}
	return newConn(c, d.RTT/2), nil
}

// Listener wraps the connections l accepts in a link of round-trip time
// RTT (each direction held RTT/2): a server every client reaches across
// the WAN, where the clients' own dialers stay plain (a test whose chain
// hops cross the WAN and whose direct reply to the head does not). The
// connection's handshake is not delayed.
type Listener struct {
	net.Listener
	RTT time.Duration
}

func (l Listener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil || l.RTT <= 0 {
		return c, err
	}
	return newConn(c, l.RTT/2), nil
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// chunk is bytes in flight on the emulated link, deliverable at due.
type chunk struct {
	b   []byte
	due time.Time
	err error // the read side's end (EOF or a socket error)
}

// queueLen bounds the chunks in flight each way; a writer that gets this
// far ahead of the link blocks, as it would on a full socket buffer.
const queueLen = 256

type conn struct {
	net.Conn
	oneWay time.Duration
	out    chan chunk // written, waiting to be sent
	in     chan chunk // received, waiting to be read
	closed chan struct{}
	once   sync.Once

	mu      sync.Mutex
	werr    error
	rerr    error // the socket's read error, returned once cur is drained
	rdl     time.Time
	rdlWake chan struct{} // closed when the read deadline changes
	cur     []byte        // the rest of the chunk Read is handing out
}

func newConn(c net.Conn, oneWay time.Duration) *conn {
	lc := &conn{Conn: c, oneWay: oneWay, out: make(chan chunk, queueLen), in: make(chan chunk, queueLen),
		closed: make(chan struct{}), rdlWake: make(chan struct{})}
	go lc.sendLoop()
	go lc.recvLoop()
	return lc
}

// closeLinger bounds how long a closed connection's last bytes may take
// to leave once they have crossed the link (a peer that reads nothing).
const closeLinger = time.Second

// sendLoop writes each chunk to the socket once it has crossed the link.
// After Close it still delivers what was written before (a server that
// answers and closes, Connection: close, is heard), then closes the
// socket: the close crosses the link behind the bytes.
func (c *conn) sendLoop() {
	defer c.Conn.Close()
	for {
		var ch chunk
		select {
		case ch = <-c.out:
		case <-c.closed:
			select {
			case ch = <-c.out:
			default:
				return
			}
		}
		if wait := time.Until(ch.due); wait > 0 {
			time.Sleep(wait)
		}
		if _, err := c.Conn.Write(ch.b); err != nil {
			c.mu.Lock()
			c.werr = err
			c.mu.Unlock()
			c.Close()
			return
		}
	}
}

// recvLoop reads the socket and stamps each chunk with when it may be read.
func (c *conn) recvLoop() {
	for {
		buf := make([]byte, 32<<10)
		n, err := c.Conn.Read(buf)
		ch := chunk{b: buf[:n], due: time.Now().Add(c.oneWay), err: err}
		select {
		case c.in <- ch:
		case <-c.closed:
			return
		}
		if err != nil {
			return
		}
	}
}

func (c *conn) Write(p []byte) (int, error) {
	c.mu.Lock()
	err := c.werr
	c.mu.Unlock()
	if err != nil {
		return 0, err
	}
	b := append([]byte(nil), p...)
	select {
	case c.out <- chunk{b: b, due: time.Now().Add(c.oneWay)}:
		return len(p), nil
	case <-c.closed:
		return 0, net.ErrClosed
	}
}

func (c *conn) Read(p []byte) (int, error) {
	c.mu.Lock()
	if len(c.cur) > 0 || c.rerr != nil {
		defer c.mu.Unlock()
		if len(c.cur) == 0 {
			return 0, c.rerr
		}
		n := copy(p, c.cur)
		c.cur = c.cur[n:]
		return n, nil
	}
	c.mu.Unlock()
	for {
		c.mu.Lock()
		dl, wake := c.rdl, c.rdlWake
		c.mu.Unlock()
		var timeout <-chan time.Time
		var timer *time.Timer
		if !dl.IsZero() {
			d := time.Until(dl)
			if d <= 0 {
				return 0, os.ErrDeadlineExceeded
			}
			timer = time.NewTimer(d)
			timeout = timer.C
		}
		select {
		case ch := <-c.in:
			if timer != nil {
				timer.Stop()
			}
			if wait := time.Until(ch.due); wait > 0 {
				time.Sleep(wait) // the link's latency; a deadline in this window is met late by at most RTT/2
			}
			n := copy(p, ch.b)
			c.mu.Lock()
			c.cur, c.rerr = ch.b[n:], ch.err
			c.mu.Unlock()
			if n == 0 && ch.err != nil {
				return 0, ch.err
			}
			return n, nil
		case <-timeout:
			return 0, os.ErrDeadlineExceeded
		case <-wake:
			// The deadline moved: wait again with the new one.
			if timer != nil {
				timer.Stop()
			}
		case <-c.closed:
			if timer != nil {
				timer.Stop()
			}
			return 0, net.ErrClosed
		}
	}
}

// SetDeadline sets the read deadline; writes never block on the link, so
// their deadline is the socket's own.
func (c *conn) SetDeadline(t time.Time) error {
	c.SetReadDeadline(t)
	return c.Conn.SetWriteDeadline(t)
}

func (c *conn) SetReadDeadline(t time.Time) error {
	c.mu.Lock()
	c.rdl = t
	close(c.rdlWake)
	c.rdlWake = make(chan struct{})
	c.mu.Unlock()
	return nil
}

// Close stops reads and writes at once; the socket closes once the bytes
// written before have crossed the link (sendLoop).
func (c *conn) Close() error {
	c.once.Do(func() {
		close(c.closed)
		c.Conn.SetWriteDeadline(time.Now().Add(c.oneWay + closeLinger))
	})
	return nil
}
