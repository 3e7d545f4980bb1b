package node

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"time"

	"meshgpu/hopmux"
	"meshgpu/wire"
)

// Punched TCP paths (docs/relay.md, "Direct paths"): tried beside QUIC on
// every punch and preferred when they work, because hops on them run the
// pinned-TLS-over-TCP code two public nodes use (a QUIC hop costs about
// twice a TCP one: docs/performance.md). Every socket of a punch binds the
// port it punches from (SO_REUSEPORT), so the mapping the relay observes
// for that port (GET /observe) is, behind a cone-like NAT, the one the
// punch gets. The offerer observes a fresh port and offers its mapping.
// The answering peer observes its punch port (where it also listens),
// starts a connection from there to the offer's mapping with a SYN of TTL
// punchTTL (punchSYN: it opens the peer's NAT towards the offerer and dies
// before the offerer's NAT), and answers its mapping. The offerer dials it
// from the offered port: its SYN passes the peer's NAT as the reply to the
// peer's SYN and meets the peer's waiting socket (a simultaneous open,
// which Linux conntrack follows). With no NAT between them the peer's SYN
// reaches the offerer, is refused, and the offerer's dial meets the
// listener instead. Either way the TLS roles are fixed: the offerer is the
// client and pins the route's peer id; the peer asks for the offerer's
// certificate and lets in only a peer that offered through the relay
// (verifyDialer), as on the QUIC path.

const (
	// tcpPunchDial bounds one observation or punched dial.
	tcpPunchDial = 3 * time.Second
	// tcpUserTimeout: a punched connection whose data goes unacknowledged
	// that long is dead (its NAT mapping is gone), as QUIC's idle timeout.
	tcpUserTimeout = directIdleTimeout
	// maxObservedBody bounds the relay's answer to GET /observe.
	maxObservedBody = 512
)

// punchKeepAlive probes a quiet punched connection as QUIC's keepalive
// does, keeping the NATs' mappings and noticing when they are gone.
var punchKeepAlive = net.KeepAliveConfig{Enable: true, Idle: directKeepAlive, Interval: directKeepAlive,
	Count: int(directIdleTimeout / directKeepAlive)}

// tcpOn: this node punches TCP paths (and offers and answers them).
func (d *DirectPaths) tcpOn() bool { return d.tcpLn != nil }

// run runs f where this node's sockets live (Place), else here.
func (d *DirectPaths) run(f func() error) error {
	if d.Place == nil {
		return f()
	}
	return d.Place(f)
}

// startTCP opens the TCP punch port on the path socket's host.
func (d *DirectPaths) startTCP(listen string) error {
	lc := net.ListenConfig{Control: punchControl, KeepAliveConfig: punchKeepAlive}
	ln, err := lc.Listen(context.Background(), "tcp", net.JoinHostPort(hostOnly(listen), "0"))
	if err != nil {
		return fmt.Errorf("direct paths: TCP punch port: %w", err)
	}
	d.tcpLn, d.tcpIn = ln, map[net.Conn]struct{}{}
	return nil
}

// tcpLocal is the address this node's answers punch from: the punch port.
func (d *DirectPaths) tcpLocal() *net.TCPAddr {
	la := *d.tcpLn.Addr().(*net.TCPAddr)
	if la.IP.IsUnspecified() {
		la.IP = nil // the wildcard of the peer's family
	}
	return &la
}

// tcpAcceptLoop serves the punched TCP paths peers dial, at most
// maxDirectConns direct paths in all.
func (d *DirectPaths) tcpAcceptLoop() {
	for {
		nc, err := d.tcpLn.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // out of descriptors: let others finish
			continue
		}
		d.serveTracked(nc, nil)
	}
}

// serveTracked serves a punched connection (once wait, if any, says it is
// open) as one of the at most maxDirectConns direct paths, until it or the
// node closes.
func (d *DirectPaths) serveTracked(nc net.Conn, wait func() error) {
	d.mu.Lock()
	if d.closed || d.inConns >= maxDirectConns {
		d.mu.Unlock()
		nc.Close()
		return
	}
	d.inConns++
	d.tcpIn[nc] = struct{}{}
	d.wg.Add(1)
	d.mu.Unlock()
	go func() {
		defer d.wg.Done()
		if wait == nil || wait() == nil {
			d.serveTCP(nc)
		} else {
			nc.Close()
		}
		d.mu.Lock()
		d.inConns--
		delete(d.tcpIn, nc)
		d.mu.Unlock()
	}()
}

// serveTCP serves one punched connection's hop frames once the dialer has
// shown the identity of a peer that offered a path (TLS 1.3, pinned).
func (d *DirectPaths) serveTCP(nc net.Conn) {
	tc := tls.Server(nc, d.serverTLS(wire.HopPunchedTCPProto))
	nc.SetDeadline(time.Now().Add(punchTimeout / 2))
	if err := tc.Handshake(); err != nil {
		nc.Close()
		d.Logger.Debug("punched TCP handshake failed", "remote", nc.RemoteAddr().String(), "error", err)
		return
	}
	nc.SetDeadline(time.Time{})
	err := serveHopFrames(d.HopServer, tc, bufio.NewReaderSize(tc, hopConnBuffer), hopmux.DefaultMaxFrame, hopIdleTimeout)
	d.Logger.Debug("punched TCP path closed", "remote", nc.RemoteAddr().String(), "cause", err)
}

// closeTCPConns drops the punched connections this node serves.
func (d *DirectPaths) closeTCPConns() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for c := range d.tcpIn {
		c.Close()
	}
}

// observeTCP asks the relay at relay (host:port) which address its NAT
// gives local (GET /observe from there; port 0: a fresh one). The
// connection stays open, holding the port, until the caller closes it.
// The request is plain HTTP: behind a wss:// or https:// relay (whose
// port speaks TLS) it fails, and the peers punch QUIC only.
func (d *DirectPaths) observeTCP(ctx context.Context, relay string, local *net.TCPAddr) (netip.AddrPort, net.Conn, error) {
	if relay == "" {
		return netip.AddrPort{}, nil, errors.New("no relay to observe the TCP punch port")
	}
	dl := net.Dialer{LocalAddr: local, Control: punchControl, Timeout: tcpPunchDial}
	var nc net.Conn
	if err := d.run(func() (err error) { nc, err = dl.DialContext(ctx, "tcp", relay); return err }); err != nil {
		return netip.AddrPort{}, nil, err
	}
	ap, err := readObserved(nc, relay)
	if err != nil {
		nc.Close()
		return netip.AddrPort{}, nil, err
	}
	return ap, nc, nil
}

func readObserved(nc net.Conn, relay string) (netip.AddrPort, error) {
	nc.SetDeadline(time.Now().Add(tcpPunchDial))
	defer nc.SetDeadline(time.Time{})
	if _, err := fmt.Fprintf(nc, "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", wire.ObservePath, relay); err != nil {
		return netip.AddrPort{}, err
	}
	// The relay's answer is a few hundred bytes: bound what is read.
	resp, err := http.ReadResponse(bufio.NewReader(io.LimitReader(nc, 8<<10)), nil)
	if err != nil {
		return netip.AddrPort{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxObservedBody+1))
	var obs wire.ObservedAddr
	if err != nil || resp.StatusCode != http.StatusOK || len(body) > maxObservedBody || json.Unmarshal(body, &obs) != nil {
		return netip.AddrPort{}, fmt.Errorf("relay %s: GET %s answered %s", relay, wire.ObservePath, resp.Status)
	}
	ap, err := netip.ParseAddrPort(obs.Addr)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("relay %s: observed %q: %w", relay, wire.Truncate(obs.Addr, 60), err)
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), nil
}

// tcpOffer is an offerer's punched TCP candidate: a fresh port's mapping as
// the relay observes it, the port, and the connection holding it (the
// caller closes it once its dial is done); nil when there is none.
func (d *DirectPaths) tcpOffer(ctx context.Context, relay string) ([]string, *net.TCPAddr, net.Conn) {
	if !d.tcpOn() {
		return nil, nil, nil
	}
	a, hold, err := d.observeTCP(ctx, relay, &net.TCPAddr{})
	if err != nil {
		d.Logger.Debug("no observed TCP address", "error", err)
		return nil, nil, nil
	}
	return []string{a.String()}, &net.TCPAddr{Port: hold.LocalAddr().(*net.TCPAddr).Port}, hold
}

// openTCPTowards answers an offer's TCP candidates: it starts a connection
// to each from the punch port (punchSYN: its first SYN opens this node's
// NAT), serves the one the offerer completes, and returns this node's
// candidate, the punch port's mapping, for the answer.
func (d *DirectPaths) openTCPTowards(ctx context.Context, theirs []netip.AddrPort) []string {
	if !d.tcpOn() || len(theirs) == 0 {
		return nil
	}
	local := d.tcpLocal()
	a, hold, err := d.observeTCP(ctx, relayUDP(d.RelayURL), local)
	if err != nil {
		d.Logger.Debug("no observed TCP address", "error", err)
		return nil
	}
	hold.Close()
	deadline := time.Now().Add(punchTimeout)
	for _, to := range theirs {
		var c net.Conn
		if err := d.run(func() (err error) { c, err = punchSYN(local, to); return err }); err != nil {
			d.Logger.Debug("TCP punch not sent", "to", to.String(), "error", err)
			continue
		}
		d.serveTracked(c, func() error { return waitConnected(c, deadline) })
	}
	return []string{a.String()}
}

// punchedConn is a connection punchSYN made, with the peer's address
// (the socket it came from could not tell it before it was open).
type punchedConn struct {
	net.Conn
	remote net.Addr
}

func (c *punchedConn) RemoteAddr() net.Addr { return c.remote }

type tcpDialResult struct {
	c   *tls.Conn
	err error
}

// dialTCP dials the peer's punched TCP candidate from local (nil: any) and
// proves, over TLS pinned to peerID, that the peer answers there.
func (d *DirectPaths) dialTCP(ctx context.Context, local *net.TCPAddr, to netip.AddrPort, peerID string) (*tls.Conn, error) {
	dl := net.Dialer{LocalAddr: local, Control: punchControl, KeepAliveConfig: punchKeepAlive, Timeout: tcpPunchDial}
	var nc net.Conn
	if err := d.run(func() (err error) { nc, err = dl.DialContext(ctx, "tcp", to.String()); return err }); err != nil {
		return nil, err
	}
	tc := tls.Client(nc, d.clientTLSFor(peerID, wire.HopPunchedTCPProto))
	hctx, cancel := context.WithTimeout(ctx, punchTimeout/2)
	defer cancel()
	if err := tc.HandshakeContext(hctx); err != nil {
		nc.Close()
		return nil, err
	}
	return tc, nil
}
