package daemon

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"testing"
	"time"

	"meshgpu/engine"
	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/model"
	"meshgpu/native"
	"meshgpu/ticket"
	"meshgpu/tracker"
	"meshgpu/wire"
)

// hop posts f32 activations to a node's /forward.
func hop(t *testing.T, hc *http.Client, url, session string, first, last, pos int, in []byte, hidden int) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequest("POST", url+"/forward", bytes.NewReader(in))
	req.Header.Set(wire.HeaderSession, session)
	req.Header.Set(wire.HeaderShape, fmt.Sprintf("%d,%d", len(in)/4/hidden, hidden))
	req.Header.Set(wire.HeaderDType, "f32")
	req.Header.Set(wire.HeaderStartLayer, fmt.Sprint(first))
	req.Header.Set(wire.HeaderEndLayer, fmt.Sprint(last))
	req.Header.Set(wire.HeaderPosition, fmt.Sprint(pos))
	if ticketFor != nil {
		req.Header.Set(wire.HeaderTicket, ticketFor(t, url, session, first, last))
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// ticketFor, when set, is the route ticket pass a hop to url carries (the
// nodes take only the tracker's tickets).
var ticketFor func(t *testing.T, url, session string, first, last int) string

// trackerTickets signs passes with the tracker's ticket key for the node
// at each url, one session key per session.
func trackerTickets(key ed25519.PrivateKey, peerOf func(url string) string) func(*testing.T, string, string, int, int) string {
	return func(t *testing.T, url, session string, first, last int) string {
		now := time.Now()
		raw, err := ticket.Sign(ticket.Ticket{SessionID: session, Head: "test-head", IssuedAt: now, Expiry: now.Add(time.Hour),
			Hops: []ticket.Hop{{PeerID: peerOf(url), Endpoint: url, First: first, Last: last}}}, key)
		if err != nil {
			t.Fatal(err)
		}
		k := make([]byte, ticket.KeySize)
		copy(k, session)
		pass, err := ticket.Pass{Ticket: raw, Keys: [][]byte{k}}.Encode()
		if err != nil {
			t.Fatal(err)
		}
		return ticket.String(pass)
	}
}

func activations(n, hidden int, seed float64) []byte {
	b := make([]byte, 4*n*hidden)
	for i := 0; i < n*hidden; i++ {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(float32(math.Sin(seed+float64(i)*0.37))))
	}
	return b
}

// A move ordered by the tracker swaps the new range in without dropping a
// session in flight: three nodes hold 0-2 (so 3-5 has no replica), the
// tracker moves one of them to 3-5; a session opened on its old range
// before the move continues there afterwards with the same activations as
// an independent stack holding 0-2, new sessions get the new range, the
// tracker sees the node re-registered with 3-5, and once the old session is
// deleted the old range is freed.
func TestMoveKeepsSessionsInFlight(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	_, trKey, _ := ed25519.GenerateKey(nil)
	tr := tracker.NewServer(tracker.Config{Endpoints: tracker.AddrPolicy{AllowLoopback: true}, Logger: log, TicketKey: trKey})
	ts := httptest.NewServer(tr.Handler())
	defer ts.Close()
	tr.Registry() // state checked below through /nodes
	peerOf := map[string]string{}
	ticketFor = trackerTickets(trKey, func(url string) string { return peerOf[url] })
	defer func() { ticketFor = nil }()

	const maxCtx, maxSessions = 64, 4
	fp := FootprintOf(cfg, "cpu", maxCtx, maxSessions)
	budget := 3*(fp.BytesPerLayer+fp.KVReservePerLayer) + max(fp.EmbedBytes, fp.HeadBytes)

	ref, err := engine.Load(dir, engine.Options{Backend: be, First: 0, Last: 2, MaxContext: maxCtx})
	if err != nil {
		t.Fatal(err)
	}
	defer ref.Close()

	hc := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{}}
	defer hc.Transport.(*http.Transport).CloseIdleConnections()
	var nodes []*Node
	for i := 0; i < 3; i++ {
		id, err := identity.LoadOrCreate(filepath.Join(t.TempDir(), "k"))
		if err != nil {
			t.Fatal(err)
		}
		n, err := Start(context.Background(), Config{ModelDir: dir, Backend: be, Identity: id, First: 0, Last: 2,
			MemoryBudget: budget, TrackerURL: ts.URL, HeartbeatInterval: 50 * time.Millisecond, MoveGrace: time.Minute,
			MaxSessions: maxSessions, MaxContext: maxCtx, HopDType: "f32", Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		defer n.Close()
		nodes = append(nodes, n)
		peerOf[n.URL()] = n.PeerID()
	}
	h := cfg.Hidden
	in0, in1 := activations(3, h, 1), activations(1, h, 2)
	// The reference: the same hops on an independent stack.
	rs, err := ref.Stack.NewSession(maxCtx)
	if err != nil {
		t.Fatal(err)
	}
	defer rs.Close()
	want0, want1 := make([]byte, len(in0)), make([]byte, len(in1))
	if err := ref.Stack.Forward([]native.Step{{Session: rs, Pos: 0, NTokens: 3}}, 0, 2, native.F32, in0, want0); err != nil {
		t.Fatal(err)
	}
	if err := ref.Stack.Forward([]native.Step{{Session: rs, Pos: 3, NTokens: 1}}, 0, 2, native.F32, in1, want1); err != nil {
		t.Fatal(err)
	}
	for i, n := range nodes {
		code, got := hop(t, hc, n.URL(), "s-old", 0, 2, 0, in0, h)
		if code != 200 || !bytes.Equal(got, want0) {
			t.Fatalf("node %d: first hop: %d (equal %v)", i, code, bytes.Equal(got, want0))
		}
	}

	var moved *Node
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(15 * time.Second); !cond(); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}
	waitFor("a move to 3-5", func() bool {
		for _, n := range nodes {
			if f, l := n.Layers(); f == 3 && l == 5 {
				moved = n
				return true
			}
		}
		return false
	})
	// The session opened before the move continues on the old range.
	code, got := hop(t, hc, moved.URL(), "s-old", 0, 2, 3, in1, h)
	if code != 200 || !bytes.Equal(got, want1) {
		t.Fatalf("hop of the old session after the move: %d %q (equal %v)", code, got[:min(len(got), 200)], bytes.Equal(got, want1))
	}
	// A new session gets the new range: the last layer samples a token.
	code, got = hop(t, hc, moved.URL(), "s-new", 3, 5, 0, in1, h)
	var tok wire.TokenReply
	if code != 200 || json.Unmarshal(got, &tok) != nil {
		t.Fatalf("new session on 3-5: %d %s", code, got)
	}
	if code, _ := hop(t, hc, moved.URL(), "s-new2", 0, 2, 0, in1, h); code != 400 {
		t.Errorf("a new session on the old range: %d, want 400 (layers outside the node's range)", code)
	}
	waitFor("the tracker to see 3-5", func() bool {
		resp, err := hc.Get(ts.URL + "/nodes")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var v struct{ Nodes []tracker.NodeRecord }
		json.NewDecoder(resp.Body).Decode(&v)
		for _, r := range v.Nodes {
			if r.PeerID == moved.PeerID() {
				return r.Layers == [2]int{3, 5}
			}
		}
		return false
	})
	// Deleting the old session lets the old range go.
	req, _ := http.NewRequest("DELETE", moved.URL()+"/sessions/s-old", nil)
	k := make([]byte, ticket.KeySize) // the session key trackerTickets put in its pass
	copy(k, "s-old")
	req.Header.Set(wire.HeaderSessionKey, base64.RawURLEncoding.EncodeToString(k))
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("DELETE old session: %d", resp.StatusCode)
	}
	waitFor("the old range to retire", func() bool {
		moved.mu.Lock()
		defer moved.mu.Unlock()
		return len(moved.retiring) == 0
	})
	if code, _ := hop(t, hc, moved.URL(), "s-old", 0, 2, 4, in1, h); code != 404 && code != 400 {
		t.Errorf("hop of the deleted session: %d, want 4xx", code)
	}
	if st := moved.Stats(); st.HopsOK < 3 {
		t.Errorf("stats after the move lost the old range's hops: %+v", st)
	}
}
