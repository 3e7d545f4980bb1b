package node

import (
	"bufio"
	"crypto/tls"
	"errors"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"meshgpu/hopmux"
	"meshgpu/identity"
	"meshgpu/wire"
)

// Encrypted hops pinned to peer ids (docs/security.md). A node serves TLS
// and plain HTTP on one port (ServeTLSAndPlain: the first byte of a
// connection tells a TLS ClientHello from a request line), with a
// certificate self-signed by its identity key. A node sending a hop to a
// peer whose peer id the ticket names dials TLS and accepts exactly the
// certificate whose key hashes to that peer id (identity.ClientTLSConfig).
// An https:// endpoint needs TLS; an http:// one falls back to plain when
// the peer does not speak TLS at all (a node with --hop-tls=false, an old
// one), never when it presents another key.

// tlsSniffTimeout bounds how long a new connection may stay silent before
// its first byte decides TLS or plain.
const tlsSniffTimeout = 10 * time.Second

// ServeTLSAndPlain wraps ln so that connections opening with a TLS
// handshake are served TLS with cfg and the others are served as they are.
func ServeTLSAndPlain(ln net.Listener, cfg *tls.Config) net.Listener {
	return &sniffListener{Listener: ln, cfg: cfg}
}

type sniffListener struct {
	net.Listener
	cfg      *tls.Config
	tlsConns atomic.Int64 // connections that turned out to be TLS
}

func (l *sniffListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &sniffConn{Conn: c, l: l}, nil
}

// sniffConn decides on its first Read (in the server's goroutine for the
// connection, so a silent client holds up nobody else).
type sniffConn struct {
	net.Conn
	l    *sniffListener
	once sync.Once
	rw   net.Conn // the TLS conn, or a conn reading the peeked byte first
	err  error
	// owner is the read deadline the HTTP server set (node/sniffdeadline.go).
	owner ownerDeadline
}

type peekedConn struct {
	net.Conn
	br *bufio.Reader
}

func (c *peekedConn) Read(p []byte) (int, error) { return c.br.Read(p) }

func (c *sniffConn) decide() {
	c.Conn.SetReadDeadline(c.sniffDeadline())
	br := bufio.NewReaderSize(c.Conn, 4<<10)
	b, err := br.Peek(1)
	c.restoreDeadline()
	if err != nil {
		c.err = err
		return
	}
	pc := &peekedConn{Conn: c.Conn, br: br}
	if b[0] == 0x16 { // TLS handshake record
		c.l.tlsConns.Add(1)
		tc := tls.Server(pc, c.l.cfg)
		if c.err = c.handshake(tc); c.err == nil {
			c.rw = tc
		}
		return
	}
	c.rw = pc
}

func (c *sniffConn) Read(p []byte) (int, error) {
	c.once.Do(c.decide)
	if c.err != nil {
		return 0, c.err
	}
	return c.rw.Read(p)
}

func (c *sniffConn) Write(p []byte) (int, error) {
	c.once.Do(c.decide)
	if c.err != nil {
		return 0, c.err
	}
	return c.rw.Write(p)
}

var _ hopmux.BuffersWriter = (*sniffConn)(nil)

// WriteBuffers keeps a frame one writev on a plain connection (hopmux.BuffersWriter).
func (c *sniffConn) WriteBuffers(bufs *net.Buffers) (int64, error) {
	c.once.Do(c.decide)
	if c.err != nil {
		return 0, c.err
	}
	if _, plain := c.rw.(*peekedConn); plain {
		return hopmux.WriteBuffers(c.Conn, bufs)
	}
	return bufs.WriteTo(c.rw)
}

// Close closes the socket (a TLS conn's close_notify is not sent: hop
// frames are length-prefixed, so a cut is always seen).
func (c *sniffConn) Close() error { return c.Conn.Close() }

// notTLS reports a peer that answered a TLS handshake with something that
// is not TLS (a plain HTTP server's 400): it does not speak TLS, which is
// not the same as presenting a certificate for another key.
func notTLS(err error) bool {
	var rh tls.RecordHeaderError
	return errors.As(err, &rh)
}

// pinnedTLS is the client config that accepts only peerID's key.
func pinnedTLS(peerID string) *tls.Config { return identity.ClientTLSConfig(peerID, nil) }

// SplitTLS serves two certificates on one port: hop connections (they
// offer wire.HopTLSProto in ALPN, as this package's pinned dialer does)
// get hop, the node's identity certificate their pin checks; every other
// client (an OpenAI SDK over https) gets api, the operator's certificate
// (`meshgpu run --tls-cert`).
func SplitTLS(hop, api *tls.Config) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		GetConfigForClient: func(hi *tls.ClientHelloInfo) (*tls.Config, error) {
			if slices.Contains(hi.SupportedProtos, wire.HopTLSProto) {
				return hop, nil
			}
			return api, nil
		},
	}
}
