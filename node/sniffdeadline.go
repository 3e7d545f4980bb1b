package node

import (
	"crypto/tls"
	"sync"
	"time"
)

// The sniffer's deadlines (docs/security.md, "Deadlines before
// authentication"). The HTTP server sets its ReadHeaderTimeout as the
// connection's read deadline before its first Read; that Read is where the
// sniffer peeks the first byte and, for TLS, runs the handshake. A net.Conn
// has no GetDeadline, so sniffConn remembers what its owner set and puts it
// back after the sniff instead of clearing it: a client sending one byte
// (0x16, or the start of a request line) and then nothing stays bound by
// the header deadline.

// ownerDeadline is the read deadline the connection's owner (the HTTP
// server) last set.
type ownerDeadline struct {
	mu sync.Mutex
	t  time.Time
}

func (d *ownerDeadline) set(t time.Time) {
	d.mu.Lock()
	d.t = t
	d.mu.Unlock()
}

func (d *ownerDeadline) get() time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.t
}

func (c *sniffConn) SetReadDeadline(t time.Time) error {
	c.owner.set(t)
	return c.Conn.SetReadDeadline(t)
}

func (c *sniffConn) SetDeadline(t time.Time) error {
	c.owner.set(t)
	return c.Conn.SetDeadline(t)
}

// sniffDeadline is the read deadline of the sniff and the TLS handshake:
// the owner's, or tlsSniffTimeout from now when that is sooner or unset.
func (c *sniffConn) sniffDeadline() time.Time {
	d := time.Now().Add(tlsSniffTimeout)
	if o := c.owner.get(); !o.IsZero() && o.Before(d) {
		return o
	}
	return d
}

// restoreDeadline gives the connection back its owner's read deadline.
func (c *sniffConn) restoreDeadline() { c.Conn.SetReadDeadline(c.owner.get()) }

// handshake completes a TLS handshake under the sniff deadline, so the
// handshake cannot outlive the owner's header deadline either.
func (c *sniffConn) handshake(tc *tls.Conn) error {
	c.Conn.SetReadDeadline(c.sniffDeadline())
	defer c.restoreDeadline()
	return tc.Handshake()
}
