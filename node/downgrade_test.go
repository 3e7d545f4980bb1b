package node

import (
	"bytes"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/wire"
)

// mitmProxy is an on-path attacker in front of a node: a TCP proxy that
// records every byte a client sends through it. Once attacking, it answers
// a TLS ClientHello with plain HTTP (as a node without TLS would), hoping
// the client falls back to plain hops, which it forwards and reads.
type mitmProxy struct {
	ln     net.Listener
	target string
	attack atomic.Bool

	mu    sync.Mutex
	seen  bytes.Buffer // client to node, in the clear as the proxy sees it
	conns []net.Conn
	wg    sync.WaitGroup
}

func startMITM(t *testing.T, target string) *mitmProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	m := &mitmProxy{ln: ln, target: strings.TrimPrefix(target, "http://")}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			m.wg.Add(1)
			go func() { defer m.wg.Done(); m.serve(c) }()
		}
	}()
	t.Cleanup(func() { ln.Close(); m.cut(); m.wg.Wait() })
	return m
}

func (m *mitmProxy) addr() string { return m.ln.Addr().String() }

func (m *mitmProxy) track(c net.Conn) {
	m.mu.Lock()
	m.conns = append(m.conns, c)
	m.mu.Unlock()
}

// cut closes every proxied connection, so the client must dial again.
func (m *mitmProxy) cut() {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, c := range m.conns {
		c.Close()
	}
	m.conns = nil
}

func (m *mitmProxy) saw(s string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return bytes.Contains(m.seen.Bytes(), []byte(s))
}

type recordTo struct{ m *mitmProxy }

func (r recordTo) Write(p []byte) (int, error) {
	r.m.mu.Lock()
	defer r.m.mu.Unlock()
	return r.m.seen.Write(p)
}

func (m *mitmProxy) serve(c net.Conn) {
	m.track(c)
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	first := make([]byte, 1)
	if _, err := io.ReadFull(c, first); err != nil {
		return
	}
	c.SetReadDeadline(time.Time{})
	if first[0] == 0x16 && m.attack.Load() {
		io.WriteString(c, "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
		return
	}
	up, err := net.Dial("tcp", m.target)
	if err != nil {
		return
	}
	m.track(up)
	defer up.Close()
	recordTo{m}.Write(first)
	up.Write(first)
	done := make(chan struct{})
	go func() { defer close(done); io.Copy(c, up) }()
	io.Copy(io.MultiWriter(up, recordTo{m}), c)
	up.Close()
	<-done
}

// An attacker on the path to a node that serves pinned hop TLS cannot
// downgrade its hops to plain by answering the TLS handshake with plain
// HTTP: a peer that has completed a pinned handshake once is never sent
// plain hops again, and an https:// endpoint (what nodes register) never
// at all. The hop fails instead, and the attacker sees no hop request in
// the clear (a plain hop connection opens with GET /hop).
func TestHopTLSCannotBeDowngraded(t *testing.T) {
	testenv.CheckGoroutines(t)
	tailID := newID(t)
	tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: tailID.PeerID, Identity: tailID}
	url, sl := serveSniffed(t, tail, tailID)
	mitm := startMITM(t, url)
	plainHop := "GET " + wire.HopPath + " "

	head := &Server{StackForTesting: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab), PeerID: "head", Logger: quietLogger()}
	t.Cleanup(func() { head.Close() })
	viaMITM := wire.Hop{Endpoint: "http://" + mitm.addr(), StartLayer: 3, EndLayer: 5, PeerID: tailID.PeerID}

	// Before the attack the proxy passes the handshake: TLS end to end.
	ids, ae := sixSteps(headPipeline(t, head, "before", []wire.Hop{viaMITM}))
	if ae != nil || !equalIDs(ids, sixStepsWant(), 6) {
		t.Fatalf("hop through the transparent proxy: %v %v", ids, ae)
	}
	if sl.tlsConns.Load() != 1 || mitm.saw(plainHop) {
		t.Fatalf("before the attack: %d TLS connections at the tail, plain hop seen %v; want 1 and false", sl.tlsConns.Load(), mitm.saw(plainHop))
	}

	// The attack: connections cut, the next handshake answered in plain.
	mitm.attack.Store(true)
	mitm.cut()
	hopsBefore := tail.metrics.hopsOK.Load()
	_, ae = sixSteps(headPipeline(t, head, "downgraded", []wire.Hop{viaMITM}))
	if ae == nil {
		t.Fatal("the hop went through an attacker answering TLS with plain HTTP")
	}
	if mitm.saw(plainHop) || tail.metrics.hopsOK.Load() != hopsBefore {
		t.Fatalf("the attacker downgraded the hop: plain hop seen %v, the tail served %d more hops (error %s: %s)",
			mitm.saw(plainHop), tail.metrics.hopsOK.Load()-hopsBefore, ae.Type, ae.Message)
	}

	// A node that has never reached the peer, given its registered
	// https:// endpoint, does not fall back either.
	fresh := &Server{StackForTesting: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab), PeerID: "fresh-head", Logger: quietLogger()}
	t.Cleanup(func() { fresh.Close() })
	https := viaMITM
	https.Endpoint = "https://" + mitm.addr()
	if _, ae := sixSteps(headPipeline(t, fresh, "fresh", []wire.Hop{https})); ae == nil || ae.Type != "hop_unreachable" {
		t.Fatalf("https endpoint behind the attacker: %+v, want hop_unreachable", ae)
	}
	if mitm.saw(plainHop) || tail.metrics.hopsOK.Load() != hopsBefore {
		t.Fatal("the attacker downgraded a hop to an https endpoint")
	}
}
