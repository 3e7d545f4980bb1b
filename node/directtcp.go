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

	"meshgpu/wire"
)

// Punched TCP paths (docs/relay.md, "Direct paths"): tried beside QUIC on
// every punch and preferred when they work, because hops on them run the
// pinned-TLS-over-TCP code two public nodes use (a QUIC hop costs about
// twice a TCP one: docs/performance.md). A node has one TCP punch port; it
// listens there, and binds its observations and dials to it too
// (SO_REUSEPORT), so the mapping the relay observes for it (GET /observe)
// is, behind a cone-like NAT, the one a dial to the peer gets. The offer
// carries the offerer's mapping; the answering peer learns its own, sends a
// SYN with TTL punchTTL towards the offerer's (it opens the peer's NAT and
// dies before the offerer's, which would answer it with a RST), and
// answers its mapping. The offerer then dials it from its punch port: the
// SYN passes the peer's NAT as the reply to that first SYN (Linux conntrack
// takes simultaneous opens) and the peer's listener accepts it. So the TLS
// roles are fixed: the dialer is the client and pins the route's peer id,
// the listener asks for the dialer's certificate and lets in only a peer
// that offered through the relay (verifyDialer), as on the QUIC path.

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

// tcpLocal is the address this node's punches bind to: the punch port.
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
		d.mu.Lock()
		if d.closed || d.inConns >= maxDirectConns {
			d.mu.Unlock()
			nc.Close()
			continue
		}
		d.inConns++
		d.tcpIn[nc] = struct{}{}
		d.wg.Add(1)
		d.mu.Unlock()
		go func() {
			defer d.wg.Done()
			d.serveTCP(nc)
			d.mu.Lock()
			d.inConns--
			delete(d.tcpIn, nc)
			d.mu.Unlock()
		}()
	}
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
	err := serveHopFrames(d.HopServer, tc, bufio.NewReaderSize(tc, hopConnBuffer), wire.DefaultMaxFrame, hopIdleTimeout)
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
// gives this node's TCP punch port (GET /observe from that port).
func (d *DirectPaths) observeTCP(ctx context.Context, relay string) (netip.AddrPort, error) {
	if relay == "" {
		return netip.AddrPort{}, errors.New("no relay to observe the TCP punch port")
	}
	dl := net.Dialer{LocalAddr: d.tcpLocal(), Control: punchControl, Timeout: tcpPunchDial}
	var nc net.Conn
	if err := d.run(func() (err error) { nc, err = dl.DialContext(ctx, "tcp", relay); return err }); err != nil {
		return netip.AddrPort{}, err
	}
	defer nc.Close()
	nc.SetDeadline(time.Now().Add(tcpPunchDial))
	if _, err := fmt.Fprintf(nc, "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", wire.ObservePath, relay); err != nil {
		return netip.AddrPort{}, err
	}
	resp, err := http.ReadResponse(bufio.NewReader(nc), nil)
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

// tcpCandidate is this node's punched TCP candidate (its punch port as the
// relay observes it), or nil.
func (d *DirectPaths) tcpCandidate(ctx context.Context, relay string) []string {
	if !d.tcpOn() {
		return nil
	}
	a, err := d.observeTCP(ctx, relay)
	if err != nil {
		d.Logger.Debug("no observed TCP address", "error", err)
		return nil
	}
	return []string{a.String()}
}

// openTCPTowards opens this node's NAT towards the offer's TCP candidates
// (one low-TTL SYN each) and returns this node's own, for the answer.
func (d *DirectPaths) openTCPTowards(ctx context.Context, theirs []netip.AddrPort) []string {
	if !d.tcpOn() || len(theirs) == 0 {
		return nil
	}
	mine := d.tcpCandidate(ctx, relayUDP(d.RelayURL))
	if mine == nil {
		return nil
	}
	local := d.tcpLocal()
	for _, a := range theirs {
		if err := d.run(func() error { return synLowTTL(local, a) }); err != nil {
			d.Logger.Debug("TCP punch not sent", "to", a.String(), "error", err)
		}
	}
	return mine
}

type tcpDialResult struct {
	c   *tls.Conn
	err error
}

// dialTCP dials the peer's punched TCP candidate from the punch port and
// proves, over TLS pinned to peerID, that the peer answers there.
func (d *DirectPaths) dialTCP(ctx context.Context, to netip.AddrPort, peerID string) (*tls.Conn, error) {
	dl := net.Dialer{LocalAddr: d.tcpLocal(), Control: punchControl, KeepAliveConfig: punchKeepAlive, Timeout: tcpPunchDial}
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
