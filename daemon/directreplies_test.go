package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/linkdelay"
	"meshgpu/internal/metricstest"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/ticket"
	"meshgpu/tracker"
	"meshgpu/wire"
)

// A tracker-routed mesh of three real nodes (0-1, 2-3, 4-5) whose head
// registered --direct-replies: the tracker's tickets name the head's
// endpoint, the tail answers it directly, and the text is one node's.
// The middle and the tail are across a WAN (their sockets hold every byte
// 10 ms each way), the tail's connection to the head is not, so a direct
// reply comes before the chain's. A client that sends its own ticket,
// route and addresses through the tracker changes nothing: the tail sends
// nothing to the address it names. With an older middle node on the route
// (it registered without ticket version 3) the tracker's tickets name no
// head address: the same text, over the chain only.
func TestTrackerRoutedDirectReplies(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	trs := tracker.NewServer(tracker.Config{Endpoints: tracker.AddrPolicy{AllowLoopback: true}, Logger: log})
	ts := httptest.NewServer(trs.Handler())
	defer ts.Close()
	hc := &http.Client{Transport: &http.Transport{}, Timeout: time.Minute}
	defer hc.CloseIdleConnections()

	start := func(first, last int, tracked, directReplies, wan bool, version int) *Node {
		t.Helper()
		id, err := identity.New()
		if err != nil {
			t.Fatal(err)
		}
		// f32 hops: the mesh then computes one node's bits (bf16 hops round
		// activations one node keeps in f32, and greedy text may part there).
		cfg := Config{ModelDir: dir, Backend: be, Identity: id, First: first, Last: last, Logger: log,
			DirectReplies: directReplies, ticketVersion: version, HopDType: "f32"}
		if tracked {
			cfg.TrackerURL = ts.URL
		}
		if wan {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			cfg.Listener = linkdelay.Listener{Listener: ln, RTT: 20 * time.Millisecond}
		}
		n, err := Start(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	one := start(0, -1, false, false, false, 0) // the reference: every layer on one node
	defer one.Close()
	head := start(0, 1, true, true, false, 0)
	defer head.Close()
	mid := start(2, 3, true, false, true, 0)
	tail := start(4, 5, true, false, true, 0)
	defer tail.Close()
	nodes, err := trs.Registry().Nodes(context.Background())
	if err != nil || len(nodes) != 3 {
		t.Fatalf("registry: %v %v", nodes, err)
	}
	modelName := nodes[0].Model

	complete := func(base string, header http.Header, prompt string) string {
		t.Helper()
		body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":16,"temperature":0}`, modelName, prompt)
		req, _ := http.NewRequest(http.MethodPost, base+"/v1/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		for k, v := range header {
			req.Header[k] = v
		}
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		var c struct {
			Choices []struct{ Text string } `json:"choices"`
		}
		if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &c) != nil || len(c.Choices) != 1 {
			t.Fatalf("completion at %s: %d %s", base, resp.StatusCode, b)
		}
		return c.Choices[0].Text
	}
	sent := func() float64 {
		v, _ := metricstest.Value(metricstest.Scrape(t, hc, tail.URL()+"/metrics"), "meshgpu_node_direct_replies_sent_total")
		return v
	}
	prompts := []string{"def add(a, b):", "func main() {"}
	refs := make([]string, len(prompts))
	for i, p := range prompts {
		refs[i] = complete(one.URL(), nil, p)
	}

	for i, p := range prompts {
		if got := complete(ts.URL, nil, p); got != refs[i] {
			t.Errorf("prompt %d with direct replies: %q, want one node's %q", i, got, refs[i])
		}
	}
	st := head.Stats()
	if st.DirectReplies == 0 || sent() == 0 {
		t.Fatalf("the head took %d direct replies (%d chain first), the tail sent %v: the tracker's tickets name no head address",
			st.DirectReplies, st.DirectChainFirst, sent())
	}

	// The client's own ticket (naming its server as the head's address),
	// route and fields reach neither the head nor the tail.
	var evilHits atomic.Int64
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { evilHits.Add(1) }))
	defer evil.Close()
	evilID, err := identity.New()
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	forged, err := ticket.Sign(ticket.Ticket{SessionID: "s", Head: head.PeerID(), HeadEndpoint: evil.URL, IssuedAt: now, Expiry: now.Add(time.Minute),
		Hops: []ticket.Hop{{PeerID: tail.PeerID(), Endpoint: evil.URL, First: 2, Last: 5}}}, evilID.Private)
	if err != nil {
		t.Fatal(err)
	}
	inject := http.Header{}
	inject.Set(wire.HeaderTicket, ticket.String(forged))
	inject.Set(wire.HeaderRoute, fmt.Sprintf(`[{"peer_id":%q,"endpoint":%q,"start_layer":2,"end_layer":5}]`, tail.PeerID(), evil.URL))
	inject.Set(wire.HeaderEndLayer, "1")
	before := head.Stats().DirectReplies
	if got := complete(ts.URL, inject, prompts[0]); got != refs[0] {
		t.Errorf("with the client's ticket and route: %q, want %q", got, refs[0])
	}
	if n := evilHits.Load(); n != 0 {
		t.Fatalf("the client's server got %d requests", n)
	}
	if head.Stats().DirectReplies == before {
		t.Error("the client's headers stopped direct replies under the tracker's ticket")
	}

	// An older middle node: version 2 tickets, chain replies, the same text.
	mid.Drain(context.Background(), 0) // deregisters: no route through it from now on
	mid.Close()
	old := start(2, 3, true, false, true, 2)
	defer old.Close()
	for wait := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		nodes, err := trs.Registry().Nodes(context.Background())
		if err == nil && !slices.ContainsFunc(nodes, func(r tracker.NodeRecord) bool { return r.PeerID == mid.PeerID() }) {
			break
		}
		if time.Now().After(wait) {
			t.Fatalf("the closed middle node is still registered: %v %v", nodes, err)
		}
	}
	sentBefore := sent()
	for { // the pushes of the last request run in the background
		time.Sleep(200 * time.Millisecond)
		s := sent()
		if s == sentBefore {
			break
		}
		sentBefore = s
	}
	headBefore := head.Stats()
	for i, p := range prompts {
		if got := complete(ts.URL, nil, p); got != refs[i] {
			t.Errorf("prompt %d with an older middle node: %q, want one node's %q", i, got, refs[i])
		}
	}
	if s, h := sent(), head.Stats(); s != sentBefore || h.DirectReplies != headBefore.DirectReplies || h.DirectChainFirst != headBefore.DirectChainFirst {
		t.Errorf("with an older middle node the tail sent %v direct replies and the head waited for %d: the ticket named the head's address",
			s-sentBefore, h.DirectReplies+h.DirectChainFirst-headBefore.DirectReplies-headBefore.DirectChainFirst)
	}

	deadline := time.Now().Add(5 * time.Second)
	for _, n := range []*Node{head, old, tail} {
		for n.Stats().Sessions != 0 {
			if time.Now().After(deadline) {
				t.Fatalf("node %s holds %d sessions after the requests", n.PeerID(), n.Stats().Sessions)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}
