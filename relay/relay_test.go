package relay

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"meshgpu/hopmux"
	"meshgpu/identity"
	"meshgpu/internal/metricstest"
	"meshgpu/internal/testenv"
)

// adrCall is a /rpc client written from ADR-0014's JSON alone: gorilla
// websocket and encoding/json, none of this package's client code.
func adrCall(t *testing.T, relayBase, peer string, msg map[string]any) map[string]any {
	t.Helper()
	ws, _, err := websocket.DefaultDialer.Dial(relayBase+"/rpc/"+peer, nil)
	if err != nil {
		t.Fatalf("dial /rpc: %v", err)
	}
	defer ws.Close()
	ws.SetReadDeadline(time.Now().Add(10 * time.Second))
	if err := ws.WriteJSON(msg); err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	if err := ws.ReadJSON(&out); err != nil {
		t.Fatalf("read /rpc answer: %v", err)
	}
	return out
}

func TestADRClientGetsBF16HopThroughBridge(t *testing.T) {
	for _, mode := range []string{"tunnel", "ws"} {
		t.Run(mode, func(t *testing.T) {
			testenv.CheckGoroutines(t)
			tb := newTestbed(t, nil, nil, func(b *Bridge) { b.DisableTunnel = mode == "ws" })
			if got := tb.bridge.Mode(); got != mode {
				t.Fatalf("bridge mode %q, want %q", got, mode)
			}
			payload := bf16Payload(2048) // 4 KiB, hidden 2048
			out := adrCall(t, tb.relayBase, tb.bridge.Identity.PeerID, map[string]any{
				"request_id": "abc123",
				"method":     "POST",
				"path":       "/forward",
				"headers": map[string]string{
					"X-Meshnet-Session": "s1", "X-Meshnet-Shape": "1,2048",
					"X-Meshnet-Start-Layer": "4", "X-Meshnet-Position": "0", "X-Meshnet-Dtype": "bf16",
				},
				"body_base64": base64.StdEncoding.EncodeToString(payload),
			})
			if out["request_id"] != "abc123" || out["status"] != float64(200) {
				t.Fatalf("answer: request_id %v status %v (%v)", out["request_id"], out["status"], out["body"])
			}
			hdr := map[string]string{}
			for k, v := range out["headers"].(map[string]any) {
				hdr[strings.ToLower(k)] = v.(string)
			}
			if hdr["x-meshnet-shape"] != "1,2048" || hdr["x-meshnet-dtype"] != "bf16" || hdr["x-meshnet-end-layer"] != "4" {
				t.Fatalf("headers: %v", hdr)
			}
			got, err := base64.StdEncoding.DecodeString(out["body_base64"].(string))
			if err != nil {
				t.Fatal(err)
			}
			if want := refTransform(payload); !bytes.Equal(got, want) {
				t.Fatalf("bf16 answer differs from the reference (%d vs %d bytes)", len(got), len(want))
			}

			// A last-hop decode answer is JSON, so it comes back as "body".
			dec := adrCall(t, tb.relayBase, tb.bridge.Identity.PeerID, map[string]any{
				"request_id": "d1", "method": "POST", "path": "/forward",
				"headers":     map[string]string{"X-Meshnet-Session": "s1", "X-Meshnet-Shape": "1,4", "X-Meshnet-Start-Layer": "11"},
				"body_base64": base64.StdEncoding.EncodeToString(payload[:8]),
			})
			text, ok := dec["body"].(string)
			if !ok || dec["body_base64"] != nil {
				t.Fatalf("decode answer should use body: %v", dec)
			}
			var tok struct {
				Token *int    `json:"token"`
				Text  string  `json:"text"`
				LP    float64 `json:"logprob"`
			}
			if err := json.Unmarshal([]byte(text), &tok); err != nil || tok.Token == nil || !strings.HasPrefix(tok.Text, "tok\u00e9\"") {
				t.Fatalf("decode body %q: %v", text, err)
			}

			// The relay's own errors keep the envelope shape with a JSON error.
			missing := adrCall(t, tb.relayBase, "mg-nobody", map[string]any{"request_id": "x", "method": "POST", "path": "/forward"})
			if missing["status"] != float64(404) || !strings.Contains(missing["body"].(string), "peer_not_connected") {
				t.Fatalf("unknown peer: %v", missing)
			}
		})
	}
}

// The same hop through Client.Do in tunnel and /rpc mode, against direct
// HTTP to the same handler.
func TestClientTunnelAndRPCGiveIdenticalAnswers(t *testing.T) {
	testenv.CheckGoroutines(t)
	tb := newTestbed(t, nil, nil, nil)
	tun := &Client{}
	defer tun.Close()
	rpc := &Client{DisableTunnel: true}
	defer rpc.Close()
	for _, n := range []int{2048, 4096, 1} {
		payload := bf16Payload(n)
		s1, h1, b1 := doHop(t, tun, tb.relayAddr(), payload, 2)
		s2, h2, b2 := doHop(t, rpc, tb.relayAddr(), payload, 2)

		resp, err := http.DefaultClient.Do(func() *http.Request {
			r := hopReq(t, payload, 2)
			r.URL, _ = r.URL.Parse(tb.directURL + "/forward")
			r.Host = ""
			return r
		}())
		if err != nil {
			t.Fatal(err)
		}
		b3, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if s1 != 200 || s2 != 200 || resp.StatusCode != 200 {
			t.Fatalf("statuses tunnel %d rpc %d direct %d: %s", s1, s2, resp.StatusCode, b2)
		}
		if !bytes.Equal(b1, b2) || !bytes.Equal(b1, b3) || !bytes.Equal(b1, refTransform(payload)) {
			t.Fatalf("bodies differ for n=%d", n)
		}
		for _, k := range []string{"Content-Type", "X-Meshnet-Shape", "X-Meshnet-Dtype", "X-Meshnet-End-Layer"} {
			if h1.Get(k) != h2.Get(k) || h1.Get(k) != resp.Header.Get(k) || h1.Get(k) == "" {
				t.Fatalf("header %s: tunnel %q rpc %q direct %q", k, h1.Get(k), h2.Get(k), resp.Header.Get(k))
			}
		}
		if len(h1) != len(h2) {
			t.Fatalf("header sets differ: tunnel %v rpc %v", h1, h2)
		}
	}
	// Node errors are answers, identical in both modes.
	bad := hopReq(t, bf16Payload(4), 2)
	bad.Header.Del("X-Meshnet-Session")
	r1, err1 := tun.Do(context.Background(), tb.relayAddr(), bad)
	bad = hopReq(t, bf16Payload(4), 2)
	bad.Header.Del("X-Meshnet-Session")
	r2, err2 := rpc.Do(context.Background(), tb.relayAddr(), bad)
	if err1 != nil || err2 != nil || r1.StatusCode != 400 || r2.StatusCode != 400 {
		t.Fatalf("node 400: %v %v", err1, err2)
	}
	e1, _ := io.ReadAll(r1.Body)
	e2, _ := io.ReadAll(r2.Body)
	if !bytes.Equal(e1, e2) || !strings.Contains(string(e1), `"error"`) {
		t.Fatalf("error bodies differ: %s vs %s", e1, e2)
	}
	// Both entry paths were really used.
	if metricValue(t, tb.relay, "meshgpu_relay_requests_total", "path=tunnel", "result=ok") < 4 ||
		metricValue(t, tb.relay, "meshgpu_relay_requests_total", "path=rpc", "result=ok") < 4 {
		t.Fatal("requests were not counted on both the tunnel and /rpc paths")
	}
	// Relay errors are errors, with the same code in both modes.
	for _, c := range []*Client{tun, rpc} {
		_, err := c.Do(context.Background(), tb.relayBase+"/rpc/mg-nobody", hopReq(t, bf16Payload(4), 2))
		var re *RelayError
		if !errors.As(err, &re) || re.Code != 404 {
			t.Fatalf("unknown peer: %v", err)
		}
	}
}

// A relay without /tunnel (an ADR-era relay): the bridge falls back to /ws
// and the client to /rpc.
func TestFallbackWhenRelayHasNoTunnel(t *testing.T) {
	testenv.CheckGoroutines(t)
	s := &Server{}
	h := s.Handler()
	old := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/tunnel" {
			http.NotFound(w, r)
			return
		}
		h.ServeHTTP(w, r)
	})
	srv := httptest.NewServer(old)
	defer srv.Close()
	defer s.Close()
	base := "ws" + strings.TrimPrefix(srv.URL, "http")
	id, _ := identity.New()
	b := &Bridge{RelayURL: base, Identity: id, Handler: TransformHandler(11)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitFor(t, "bridge on /ws", 5*time.Second, func() bool { return b.Mode() == "ws" && s.hasPeer(id.PeerID) })
	c := &Client{}
	defer c.Close()
	payload := bf16Payload(300)
	st, _, body := doHop(t, c, base+"/rpc/"+id.PeerID, payload, 1)
	if st != 200 || !bytes.Equal(body, refTransform(payload)) {
		t.Fatalf("fallback hop: %d", st)
	}
	if metricValue(t, s, "meshgpu_relay_requests_total", "path=rpc", "result=ok") != 1 {
		t.Fatal("the client did not fall back to /rpc")
	}
}

// rawTunnel registers with hand-made hello fields (for auth tests).
func rawTunnel(t *testing.T, base string, id *identity.Identity, token string, accepts bool) (*tconn, error) {
	t.Helper()
	o := dialOpts{base: base, id: id, joinToken: token, maxFrame: hopmux.DefaultMaxFrame, pingInterval: time.Second, reqTimeout: time.Second}
	if accepts {
		o.handler = TransformHandler(11)
		o.maxInflight = 4
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return dialTunnel(ctx, o)
}

func TestRegistrationCannotClaimAnotherPeerID(t *testing.T) {
	testenv.CheckGoroutines(t)
	tb := newTestbed(t, nil, nil, nil)
	victim := tb.bridge.Identity
	mine, _ := identity.New()

	// Own key, victim's id.
	forged := &identity.Identity{Private: mine.Private, Public: mine.Public, PeerID: victim.PeerID}
	// Victim's id and public key, signed with another key.
	wrongSig := &identity.Identity{Private: mine.Private, Public: victim.Public, PeerID: victim.PeerID}
	for name, id := range map[string]*identity.Identity{"own key": forged, "wrong signature": wrongSig} {
		_, err := rawTunnel(t, tb.relayBase, id, "", true)
		var re *RelayError
		if !errors.As(err, &re) || re.Code != http.StatusUnauthorized {
			t.Fatalf("%s: tunnel registration as the victim: %v, want 401", name, err)
		}
		// The same over /ws.
		ws, _, err := websocket.DefaultDialer.Dial(tb.relayBase+"/ws", nil)
		if err != nil {
			t.Fatal(err)
		}
		var ch wsHello
		ws.ReadJSON(&ch)
		ws.WriteJSON(wsHello{Type: "register", PeerID: id.PeerID, PublicKey: id.PublicHex(),
			Signature: hexSig(id, ch.Nonce)})
		var ans wsHello
		ws.ReadJSON(&ans)
		ws.Close()
		if ans.Type != "error" {
			t.Fatalf("%s: /ws registration as the victim answered %+v", name, ans)
		}
	}
	if metricValue(t, tb.relay, "meshgpu_relay_auth_failures_total") != 4 {
		t.Fatalf("auth failures = %v, want 4", metricValue(t, tb.relay, "meshgpu_relay_auth_failures_total"))
	}
	// The victim is still the one answering.
	c := &Client{}
	defer c.Close()
	if st, _, _ := doHop(t, c, tb.relayAddr(), bf16Payload(8), 1); st != 200 {
		t.Fatalf("victim no longer reachable: %d", st)
	}
	// A signature over another nonce (replay) fails too.
	ws, _, err := websocket.DefaultDialer.Dial(tb.relayBase+"/ws", nil)
	if err != nil {
		t.Fatal(err)
	}
	var ch wsHello
	ws.ReadJSON(&ch)
	ws.WriteJSON(wsHello{Type: "register", PeerID: mine.PeerID, PublicKey: mine.PublicHex(), Signature: hexSig(mine, "00"+ch.Nonce[2:])})
	var ans wsHello
	ws.ReadJSON(&ans)
	ws.Close()
	if ans.Type != "error" {
		t.Fatalf("replayed signature accepted: %+v", ans)
	}
}

func hexSig(id *identity.Identity, nonce string) string {
	sig := ed25519.Sign(id.Private, ChallengeMessage(nonce, id.PeerID))
	const digits = "0123456789abcdef"
	out := make([]byte, 0, 2*len(sig))
	for _, b := range sig {
		out = append(out, digits[b>>4], digits[b&15])
	}
	return string(out)
}

func TestJoinTokenRequired(t *testing.T) {
	testenv.CheckGoroutines(t)
	tb := newTestbed(t, nil, &Server{JoinToken: "s3cret"}, nil) // the testbed bridge uses the token
	id, _ := identity.New()
	b := &Bridge{RelayURL: tb.relayBase, Identity: id, Handler: TransformHandler(11), JoinToken: "wrong"}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := b.Run(ctx)
	if err == nil || !strings.Contains(err.Error(), "join token") {
		t.Fatalf("bridge with a wrong token: %v, want a refusal naming the join token", err)
	}
	b2 := &Bridge{RelayURL: tb.relayBase, Identity: id, Handler: TransformHandler(11), DisableTunnel: true}
	if err := b2.Run(ctx); err == nil || !strings.Contains(err.Error(), "join token") {
		t.Fatalf("/ws bridge without a token: %v", err)
	}
	// /rpc and tunnel clients need it too.
	for _, c := range []*Client{{DisableTunnel: true}, {}} {
		_, err := c.Do(ctx, tb.relayAddr(), hopReq(t, bf16Payload(4), 1))
		var re *RelayError
		if !errors.As(err, &re) || (re.Code != 401 && re.Code != 403) {
			t.Fatalf("client without token: %v", err)
		}
		c.Close()
	}
	c := &Client{JoinToken: "s3cret", JoinTokenRelay: tb.relayBase}
	defer c.Close()
	if st, _, _ := doHop(t, c, tb.relayAddr(), bf16Payload(4), 1); st != 200 {
		t.Fatalf("with the token: %d", st)
	}
}

func TestUnknownResponseIDIsDroppedAndCounted(t *testing.T) {
	testenv.CheckGoroutines(t)
	tb := newTestbed(t, nil, nil, nil)
	// A tunnel peer answers a request nobody sent.
	id, _ := identity.New()
	tc, err := rawTunnel(t, tb.relayBase, id, "", true)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { tc.run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	r := hopmux.TunnelResponse{ID: 987654321, Status: 200, Body: []byte("stray")}
	head, _ := r.AppendHead(nil)
	tc.c.send(outMsg{head: head, body: r.Body})
	// A /ws peer does the same.
	ws := wsRegister(t, tb.relayBase)
	defer ws.Close()
	ws.WriteJSON(map[string]any{"type": "relay-http-response", "request_id": "ffff0001", "status": 200, "headers": map[string]string{}, "body": "stray"})
	ws.WriteJSON(map[string]any{"type": "relay-http-response", "request_id": "not-hex", "status": 200})
	waitFor(t, "3 unknown responses counted", 5*time.Second, func() bool {
		return metricValue(t, tb.relay, "meshgpu_relay_unknown_responses_total") == 3
	})
	// Nothing broke: both connections stay registered and hops still work.
	c := &Client{}
	defer c.Close()
	if st, _, _ := doHop(t, c, tb.relayAddr(), bf16Payload(8), 1); st != 200 {
		t.Fatal("hop failed after stray responses")
	}
	if !tb.relay.hasPeer(id.PeerID) {
		t.Fatal("a stray response closed the tunnel peer")
	}
}

// wsRegister registers a fresh identity on /ws by hand.
func wsRegister(t *testing.T, base string) *websocket.Conn {
	t.Helper()
	id, _ := identity.New()
	ws, _, err := websocket.DefaultDialer.Dial(base+"/ws", nil)
	if err != nil {
		t.Fatal(err)
	}
	var ch wsHello
	if err := ws.ReadJSON(&ch); err != nil {
		t.Fatal(err)
	}
	ws.WriteJSON(wsHello{Type: "register", PeerID: id.PeerID, PublicKey: id.PublicHex(), Signature: hexSig(id, ch.Nonce)})
	var ans wsHello
	if err := ws.ReadJSON(&ans); err != nil || ans.Type != "registered" {
		t.Fatalf("register: %+v %v", ans, err)
	}
	return ws
}

func TestOversizedFrameClosesOnlyThatConnection(t *testing.T) {
	testenv.CheckGoroutines(t)
	tb := newTestbed(t, nil, &Server{MaxFrameBytes: 64 << 10}, nil)
	good := &Client{}
	defer good.Close()
	if st, _, _ := doHop(t, good, tb.relayAddr(), bf16Payload(1024), 1); st != 200 {
		t.Fatal("warm-up hop failed")
	}
	// A tunnel peer that ignores the relay's advertised limit (our client
	// honours it) sends a 128 KiB frame; the relay closes its connection.
	bad, _ := identity.New()
	tc, err := rawTunnel(t, tb.relayBase, bad, "", false)
	if err != nil {
		t.Fatal(err)
	}
	runErr := make(chan error, 1)
	go func() { runErr <- tc.run(context.Background()) }()
	big := bf16Payload(64 << 10)
	q := hopmux.TunnelRequest{ID: 1, Peer: tb.bridge.Identity.PeerID, Method: http.MethodPost, Path: "/forward", Body: big}
	head, _ := q.AppendHead(nil)
	tc.c.send(outMsg{head: head, body: big})
	select {
	case <-runErr:
	case <-time.After(5 * time.Second):
		t.Fatal("the relay kept a tunnel that sent an oversized frame")
	}
	// An oversized /rpc message likewise.
	ws, _, derr := websocket.DefaultDialer.Dial(tb.relayAddr(), nil)
	if derr != nil {
		t.Fatal(derr)
	}
	ws.WriteMessage(websocket.TextMessage, bytes.Repeat([]byte("a"), 200<<10))
	ws.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, _, err := ws.ReadMessage(); err == nil {
		t.Fatal("oversized /rpc message got an answer")
	}
	ws.Close()
	waitFor(t, "2 oversize closes", 5*time.Second, func() bool {
		return metricValue(t, tb.relay, "meshgpu_relay_oversize_closes_total") == 2
	})
	// The healthy client's tunnel and the bridge were untouched.
	for i := 0; i < 3; i++ {
		if st, _, _ := doHop(t, good, tb.relayAddr(), bf16Payload(1024), 1); st != 200 {
			t.Fatal("healthy client's hop failed after another client's oversized frame")
		}
	}
	if !tb.bridge.Connected() {
		t.Fatal("bridge dropped")
	}
	if metricValue(t, tb.relay, "meshgpu_relay_replaced_connections_total") != 0 {
		t.Fatal("connections were replaced")
	}
}

func p50(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

// A flooding peer gets 429s while a healthy session's hop p50 stays within
// 2x of its p50 before the flood. The handler takes 2 ms, standing in for a
// layer's compute, so the relay's own share is what is measured.
func TestFloodingPeerIsLimited(t *testing.T) {
	testenv.CheckGoroutines(t)
	slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(2 * time.Millisecond)
		TransformHandler(11).ServeHTTP(w, r)
	})
	tb := newTestbed(t, slow, &Server{MaxInflightPerPeer: 4}, nil)
	healthy := &Client{}
	defer healthy.Close()
	payload := bf16Payload(2048)
	measure := func(n int) []time.Duration {
		var d []time.Duration
		for i := 0; i < n; i++ {
			t0 := time.Now()
			if st, _, _ := doHop(t, healthy, tb.relayAddr(), payload, 1); st != 200 {
				t.Fatalf("healthy hop %d", st)
			}
			d = append(d, time.Since(t0))
		}
		return d
	}
	measure(10)
	flooder := &Client{BusyWait: -1} // an attacker does not wait its 429s out
	defer flooder.Close()
	flood := func() (stop func() (ok, limited int64)) {
		ctx, cancel := context.WithCancel(context.Background())
		var limited, ok atomic.Int64
		var wg sync.WaitGroup
		for g := 0; g < 16; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for ctx.Err() == nil {
					resp, err := flooder.Do(ctx, tb.relayAddr(), hopReq(t, payload, 1))
					var re *RelayError
					switch {
					case errors.As(err, &re) && re.Code == http.StatusTooManyRequests:
						limited.Add(1)
					case err == nil:
						resp.Body.Close()
						ok.Add(1)
					}
				}
			}()
		}
		waitFor(t, "the flood to be limited", 5*time.Second, func() bool { return limited.Load() > 50 })
		return func() (int64, int64) { cancel(); wg.Wait(); return ok.Load(), limited.Load() }
	}
	// Other packages' tests share the 2 cores, so a round disturbed from
	// outside is retried; a relay that lets floods through fails all three.
	for round := 1; ; round++ {
		before := p50(measure(60))
		stop := flood()
		during := p50(measure(60))
		ok, limited := stop()
		t.Logf("round %d: healthy p50 before %v, during flood %v; flooder ok %d, limited %d", round, before, during, ok, limited)
		if limited == 0 {
			t.Fatal("the flooder was never limited")
		}
		if raceEnabled {
			t.Log("race detector on: the 2x latency bound is not checked")
			break
		}
		if during <= 2*before {
			break
		}
		if round == 3 {
			t.Fatalf("healthy p50 went from %v to %v during the flood (> 2x) in 3 rounds", before, during)
		}
	}
	if metricValue(t, tb.relay, "meshgpu_relay_requests_total", "path=tunnel", "result=rate_limited") == 0 {
		t.Fatal("limited requests not counted")
	}
}

// The relay restarts while a hop is in flight. By default the sender
// resends it (a hop is a redo of its position) once the relay is back and
// the bridge has reconnected, within the hop's deadline: the hop is
// answered, not failed. With ReconnectWait < 0 it fails promptly with an
// error instead. Either way the bridge reconnects with backoff and the
// next hop works.
func TestRelayRestartMidGeneration(t *testing.T) {
	t.Run("resent after reconnect", func(t *testing.T) { relayRestartMidGeneration(t, 0) })
	t.Run("fails promptly without waiting", func(t *testing.T) { relayRestartMidGeneration(t, -1) })
}

func relayRestartMidGeneration(t *testing.T, reconnectWait time.Duration) {
	testenv.CheckGoroutines(t)
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	var once sync.Once
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		first := false
		if r.Header.Get("X-Meshnet-Position") == "999" {
			once.Do(func() { first = true })
		}
		if first { // the answer the relay restart loses
			entered <- struct{}{}
			select {
			case <-release:
			case <-r.Context().Done():
			}
			return
		}
		TransformHandler(11).ServeHTTP(w, r)
	})
	tb := newTestbed(t, h, nil, func(b *Bridge) { b.PingInterval = 200 * time.Millisecond })
	defer close(release)
	c := &Client{PingInterval: 200 * time.Millisecond, ReconnectWait: reconnectWait}
	defer c.Close()
	if st, _, _ := doHop(t, c, tb.relayAddr(), bf16Payload(64), 1); st != 200 {
		t.Fatal("first token failed")
	}
	type answer struct {
		status int
		body   []byte
		err    error
	}
	inflight := bf16Payload(64)
	done := make(chan answer, 1)
	go func() {
		req := hopReq(t, inflight, 1)
		req.Header.Set("X-Meshnet-Position", "999")
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		resp, err := c.Do(ctx, tb.relayAddr(), req)
		if err != nil {
			done <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		done <- answer{resp.StatusCode, b, err}
	}()
	<-entered
	addr := tb.relayLn.Addr().String()
	t0 := time.Now()
	tb.closeRelay()
	if reconnectWait < 0 {
		select {
		case a := <-done:
			if a.err == nil {
				t.Fatal("in-flight hop succeeded across a relay restart")
			}
			if errors.Is(a.err, context.DeadlineExceeded) || time.Since(t0) > 5*time.Second {
				t.Fatalf("in-flight hop hung: %v after %v", a.err, time.Since(t0))
			}
		case <-time.After(10 * time.Second):
			t.Fatal("in-flight hop did not fail within 10s of the relay going down")
		}
	}
	waitFor(t, "bridge to notice", 5*time.Second, func() bool { return !tb.bridge.Connected() })

	// A new relay on the same address.
	var ln net.Listener
	var err error
	for i := 0; i < 50; i++ {
		if ln, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("relisten %s: %v", addr, err)
	}
	s2 := &Server{Logger: tb.relay.Logger}
	srv2 := &http.Server{Handler: s2.Handler()}
	served := make(chan struct{})
	go func() { defer close(served); srv2.Serve(ln) }()
	defer func() { <-served }()
	defer srv2.Close()
	defer s2.Close()
	tb.relay, tb.relaySrv, tb.relayDone = s2, srv2, make(chan struct{}) // testbed Close must not touch the old one
	close(tb.relayDone)
	if reconnectWait >= 0 {
		select {
		case a := <-done:
			if a.err != nil || a.status != 200 || !bytes.Equal(a.body, refTransform(inflight)) {
				t.Fatalf("in-flight hop across the relay restart: %d %v, want it resent and answered", a.status, a.err)
			}
			t.Logf("in-flight hop answered %v after the relay went down", time.Since(t0).Round(time.Millisecond))
		case <-time.After(15 * time.Second):
			t.Fatal("in-flight hop not answered 15 s after the relay went down")
		}
	}
	waitFor(t, "bridge to reconnect", 10*time.Second, func() bool { return tb.bridge.Connected() && s2.hasPeer(tb.bridge.Identity.PeerID) })
	payload := bf16Payload(512)
	st, _, body := doHop(t, c, tb.relayAddr(), payload, 1)
	if st != 200 || !bytes.Equal(body, refTransform(payload)) {
		t.Fatalf("next token after restart: %d", st)
	}
}

// Cancelling a hop (client deadline) reaches the node's handler.
func TestCancelReachesHandler(t *testing.T) {
	testenv.CheckGoroutines(t)
	cancelled := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
			close(cancelled)
		case <-time.After(10 * time.Second):
		}
	})
	tb := newTestbed(t, h, nil, nil)
	c := &Client{}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := c.Do(ctx, tb.relayAddr(), hopReq(t, bf16Payload(4), 1))
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err %v, want deadline exceeded", err)
	}
	select {
	case <-cancelled:
	case <-time.After(5 * time.Second):
		t.Fatal("the node's handler was not cancelled")
	}
}

func TestHealthMetricsAndNotFound(t *testing.T) {
	testenv.CheckGoroutines(t)
	tb := newTestbed(t, nil, nil, nil)
	base := "http" + strings.TrimPrefix(tb.relayBase, "ws")
	get := func(path string) (int, string) {
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	st, body := get("/health")
	var h map[string]any
	if st != 200 || json.Unmarshal([]byte(body), &h) != nil || h["peers"] != float64(1) || h["tunnels"] != float64(1) {
		t.Fatalf("health %d %s", st, body)
	}
	st, body = get("/metrics")
	for _, name := range []string{"meshgpu_relay_peers", "meshgpu_relay_unknown_responses_total", "meshgpu_relay_oversize_closes_total"} {
		if st != 200 || !strings.Contains(body, name) {
			t.Fatalf("/metrics lacks %s", name)
		}
	}
	// promlint-clean, with the build and runtime series every server has
	fams := metricstest.Scrape(t, http.DefaultClient, base+"/metrics")
	for _, name := range []string{"meshgpu_build_info", "go_goroutines", "process_open_fds", "meshgpu_relay_peers"} {
		if _, ok := metricstest.Value(fams, name); !ok {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	st, body = get("/nope")
	if st != 404 || !strings.Contains(body, `"type":"not_found"`) {
		t.Fatalf("404: %d %s", st, body)
	}
	st, body = get("/tunnel") // not a WebSocket upgrade
	if st != 400 || !strings.Contains(body, `"error"`) {
		t.Fatalf("plain GET /tunnel: %d %s", st, body)
	}
	resp, err := http.Post(base+"/ws", "text/plain", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 405 || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("POST /ws: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	st, body = get("/rpc/bad%20id")
	if st != 400 || !strings.Contains(body, `"error"`) {
		t.Fatalf("bad peer id: %d %s", st, body)
	}
}

// A node's Client can send its hops over its own Bridge's tunnel: one
// connection per node and relay, used in both directions.
func TestClientReusesBridgeTunnel(t *testing.T) {
	testenv.CheckGoroutines(t)
	tb := newTestbed(t, nil, nil, nil)
	// A second node, bridged, that sends hops to the first through its own tunnel.
	id, _ := identity.New()
	b := &Bridge{RelayURL: tb.relayBase, Identity: id, Handler: TransformHandler(11)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitFor(t, "second bridge", 5*time.Second, func() bool { return tb.relay.hasPeer(id.PeerID) })
	c := &Client{Identity: id, Bridge: b}
	defer c.Close()
	payload := bf16Payload(100)
	for i := 0; i < 3; i++ {
		if st, _, body := doHop(t, c, tb.relayAddr(), payload, 1); st != 200 || !bytes.Equal(body, refTransform(payload)) {
			t.Fatalf("hop over the bridge's tunnel: %d", st)
		}
	}
	// And the reverse direction on the same connection.
	c2 := &Client{}
	defer c2.Close()
	if st, _, _ := doHop(t, c2, tb.relayBase+"/rpc/"+id.PeerID, payload, 1); st != 200 {
		t.Fatalf("hop to the second node: %d", st)
	}
	tb.relay.mu.Lock()
	conns := len(tb.relay.conns)
	tb.relay.mu.Unlock()
	if conns != 3 { // two bridges and c2; c dialed nothing
		t.Fatalf("relay has %d connections, want 3", conns)
	}
}

// A bridge at its in-flight cap answers at once instead of queueing.
func TestBridgeInflightCap(t *testing.T) {
	for _, mode := range []string{"tunnel", "ws"} {
		t.Run(mode, func(t *testing.T) {
			testenv.CheckGoroutines(t)
			entered := make(chan struct{}, 1)
			release := make(chan struct{})
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				entered <- struct{}{}
				<-release
			})
			tb := newTestbed(t, h, nil, func(b *Bridge) { b.MaxInflight = 1; b.DisableTunnel = mode == "ws" })
			c := &Client{BusyWait: -1} // the bridge's own answer, not the client's waiting
			defer c.Close()
			first := make(chan error, 1)
			go func() {
				resp, err := c.Do(context.Background(), tb.relayAddr(), hopReq(t, bf16Payload(4), 1))
				if err == nil {
					resp.Body.Close()
				}
				first <- err
			}()
			<-entered
			t0 := time.Now()
			resp, err := c.Do(context.Background(), tb.relayAddr(), hopReq(t, bf16Payload(4), 1))
			var re *RelayError
			busy := errors.As(err, &re) && re.Code == 429 || err == nil && resp.StatusCode == 429
			if !busy || time.Since(t0) > 2*time.Second {
				t.Fatalf("second request at the cap: %v %v after %v, want an immediate 429", resp, err, time.Since(t0))
			}
			close(release)
			if err := <-first; err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A handler that flushes (SSE, as the OpenAI API streams) is streamed
// through the tunnel as it writes; /rpc and /ws get the same bytes whole.
func TestStreamedAnswerThroughTunnel(t *testing.T) {
	testenv.CheckGoroutines(t)
	var gate chan struct{}
	var mu sync.Mutex
	handlerDone := make(chan error, 4)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		g := gate
		mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		w.Write([]byte("data: {\"n\":1}\n\n"))
		w.(http.Flusher).Flush()
		select {
		case <-g:
		case <-r.Context().Done():
			handlerDone <- r.Context().Err()
			return
		}
		for i := 2; i <= 40; i++ {
			w.Write([]byte("data: {\"n\":" + string(rune('0'+i%10)) + "}\n\n"))
			if i%3 == 0 {
				w.(http.Flusher).Flush()
			}
		}
		w.Write([]byte("data: [DONE]\n\n"))
		handlerDone <- nil
	})
	tb := newTestbed(t, h, nil, nil)
	setGate := func() chan struct{} {
		mu.Lock()
		defer mu.Unlock()
		gate = make(chan struct{})
		return gate
	}
	sse := func() *http.Request {
		r, _ := http.NewRequest(http.MethodPost, "http://node/v1/chat/completions", strings.NewReader(`{"stream":true}`))
		return r
	}

	tun := &Client{}
	defer tun.Close()
	g := setGate()
	resp, err := tun.Do(context.Background(), tb.relayAddr(), sse())
	if err != nil {
		t.Fatal(err)
	}
	first := make([]byte, len("data: {\"n\":1}\n\n"))
	if _, err := io.ReadFull(resp.Body, first); err != nil || string(first) != "data: {\"n\":1}\n\n" {
		t.Fatalf("first event before the handler finished: %q %v", first, err)
	}
	if resp.ContentLength != -1 || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("streamed head: %d %v", resp.ContentLength, resp.Header)
	}
	close(g) // only now may the handler go on
	rest, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || <-handlerDone != nil {
		t.Fatal(err)
	}
	streamed := append(first, rest...)

	for _, mode := range []string{"rpc", "ws"} {
		var c *Client
		base := tb.relayAddr()
		if mode == "rpc" {
			c = &Client{DisableTunnel: true}
		} else {
			// A second node on /ws, which cannot stream.
			id, _ := identity.New()
			b := &Bridge{RelayURL: tb.relayBase, Identity: id, Handler: h, DisableTunnel: true}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- b.Run(ctx) }()
			defer func() { cancel(); <-done }()
			waitFor(t, "ws bridge", 5*time.Second, func() bool { return tb.relay.hasPeer(id.PeerID) })
			c, base = &Client{}, tb.relayBase+"/rpc/"+id.PeerID
		}
		close(setGate())
		resp, err := c.Do(context.Background(), base, sse())
		if err != nil {
			t.Fatal(err)
		}
		whole, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		c.Close()
		<-handlerDone
		if !bytes.Equal(whole, streamed) {
			t.Fatalf("%s answer differs from the streamed one:\n%q\n%q", mode, whole, streamed)
		}
	}

	// Closing a stream early cancels the handler.
	setGate()
	resp, err = tun.Do(context.Background(), tb.relayAddr(), sse())
	if err != nil {
		t.Fatal(err)
	}
	io.ReadFull(resp.Body, first)
	resp.Body.Close()
	select {
	case err := <-handlerDone:
		if err == nil {
			t.Fatal("handler finished instead of being cancelled")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("closing the body did not cancel the handler")
	}
}

// A peer that stops reading is dropped once its send queue is full or a
// write times out; nobody else waits for it.
func TestSlowReaderIsDroppedWithoutBlockingOthers(t *testing.T) {
	testenv.CheckGoroutines(t)
	tb := newTestbed(t, nil, &Server{SendQueue: 100, WriteTimeout: 300 * time.Millisecond, MaxInflightPerPeer: 1000}, nil)
	// A registered peer that never reads its socket.
	id, _ := identity.New()
	slow, err := rawTunnel(t, tb.relayBase, id, "", true)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.c.close(errors.New("test over"))
	waitFor(t, "slow peer registered", 5*time.Second, func() bool { return tb.relay.hasPeer(id.PeerID) })

	c := &Client{}
	defer c.Close()
	big := bf16Payload(128 << 10) // 256 KiB per request, 64 of them: more than loopback buffers hold
	var wg sync.WaitGroup
	var failed atomic.Int64
	for i := 0; i < 64; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			if _, err := c.Do(ctx, tb.relayBase+"/rpc/"+id.PeerID, hopReq(t, big, 1)); err != nil {
				failed.Add(1)
			}
		}()
	}
	// Meanwhile the healthy node answers promptly.
	for i := 0; i < 5; i++ {
		t0 := time.Now()
		if st, _, _ := doHop(t, c, tb.relayAddr(), bf16Payload(2048), 1); st != 200 || time.Since(t0) > 2*time.Second {
			t.Fatalf("healthy hop: %d after %v", st, time.Since(t0))
		}
	}
	wg.Wait()
	if failed.Load() != 64 {
		t.Fatalf("%d of 64 requests to the stalled peer failed, want all", failed.Load())
	}
	waitFor(t, "slow peer dropped", 5*time.Second, func() bool { return !tb.relay.hasPeer(id.PeerID) })
	if metricValue(t, tb.relay, "meshgpu_relay_slow_peer_drops_total") != 1 {
		t.Fatalf("slow drops = %v, want 1", metricValue(t, tb.relay, "meshgpu_relay_slow_peer_drops_total"))
	}
	if !tb.bridge.Connected() {
		t.Fatal("the healthy bridge was dropped")
	}
}

// wss:// works end to end: bridge, tunnel client and /rpc client.
func TestTLSRelay(t *testing.T) {
	testenv.CheckGoroutines(t)
	s := &Server{}
	srv := httptest.NewTLSServer(s.Handler())
	defer srv.Close()
	defer s.Close()
	tlsConf := srv.Client().Transport.(*http.Transport).TLSClientConfig
	base := "wss" + strings.TrimPrefix(srv.URL, "https")
	id, _ := identity.New()
	b := &Bridge{RelayURL: base, Identity: id, Handler: TransformHandler(11), TLSConfig: tlsConf}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitFor(t, "bridge over wss", 5*time.Second, func() bool { return b.Mode() == "tunnel" && s.hasPeer(id.PeerID) })
	payload := bf16Payload(2048)
	for _, c := range []*Client{{TLSConfig: tlsConf}, {TLSConfig: tlsConf, DisableTunnel: true}} {
		st, _, body := doHop(t, c, base+"/rpc/"+id.PeerID, payload, 1)
		c.Close()
		if st != 200 || !bytes.Equal(body, refTransform(payload)) {
			t.Fatalf("hop over wss: %d", st)
		}
	}
	// Without the relay's certificate the client refuses the relay.
	c := &Client{}
	defer c.Close()
	if _, err := c.Do(context.Background(), base+"/rpc/"+id.PeerID, hopReq(t, payload, 1)); err == nil {
		t.Fatal("connected to a relay with an untrusted certificate")
	}
}

// A node whose own frame limit is larger than the relay's must not send a
// frame the relay refuses: the relay would close the node's only tunnel,
// failing every hop in flight on it. Too large an answer or request fails
// alone, and the tunnel stays up.
func TestFramesBeyondTheRelayLimitAreNotSent(t *testing.T) {
	testenv.CheckGoroutines(t)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Big") != "" {
			w.Write(make([]byte, 100<<10))
			return
		}
		TransformHandler(11).ServeHTTP(w, r)
	})
	tb := newTestbed(t, h, &Server{MaxFrameBytes: 64 << 10}, nil) // the bridge keeps the 16 MiB default
	c := &Client{}
	defer c.Close()
	if st, _, _ := doHop(t, c, tb.relayAddr(), bf16Payload(1024), 1); st != 200 {
		t.Fatal("warm-up hop failed")
	}
	big := hopReq(t, bf16Payload(1024), 1)
	big.Header.Set("X-Big", "1")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if resp, err := c.Do(ctx, tb.relayAddr(), big); err == nil {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == 200 {
			t.Fatalf("a %d-byte answer passed a 64 KiB relay", len(b))
		}
	}
	// The client's own tunnel: a request over the relay's limit fails
	// before it is sent.
	if _, err := c.Do(ctx, tb.relayAddr(), hopReq(t, bf16Payload(40<<10), 1)); err == nil {
		t.Fatal("an 80 KiB hop passed a 64 KiB relay")
	}
	if n := metricValue(t, tb.relay, "meshgpu_relay_oversize_closes_total"); n != 0 {
		t.Fatalf("the relay closed %v connections for oversized frames", n)
	}
	payload := bf16Payload(1024)
	if st, _, body := doHop(t, c, tb.relayAddr(), payload, 1); st != 200 || !bytes.Equal(body, refTransform(payload)) {
		t.Fatal("hop after the refused ones failed")
	}
}

// A relay with a short idle timeout advertises a ping interval that keeps
// its nodes within it, and nodes follow the advertisement even when their
// own interval is longer: an idle bridge is not dropped and redialled.
func TestIdleBridgeFollowsTheRelayPingInterval(t *testing.T) {
	testenv.CheckGoroutines(t)
	tb := newTestbed(t, nil, &Server{IdleTimeout: 900 * time.Millisecond}, nil) // the bridge keeps its 15 s default
	first := tb.bridge.cur.Load()
	time.Sleep(2 * time.Second) // more than two idle timeouts
	if cur := tb.bridge.cur.Load(); cur != first || !tb.bridge.Connected() {
		t.Fatal("the relay dropped an idle bridge that kept its own ping interval")
	}
}

// A hop cancelled just as its streamed answer starts (the read loop has
// taken the waiter and registered the stream, but not yet handed it over)
// must not leave the stream registered on the shared tunnel, where it
// would stay for the tunnel's lifetime.
func TestCancelRacingAStreamLeavesNoStream(t *testing.T) {
	tc := &tconn{
		c:       newWSConn(nil, DefaultSendQueue, time.Second, websocket.BinaryMessage), // queue only: nothing is written
		sendMax: hopmux.DefaultMaxFrame,
		waiting: map[uint64]chan tresult{},
		streams: map[uint64]*streamBody{},
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, _, err := tc.roundTrip(ctx, "peer", http.MethodPost, "/v1/completions", nil, nil)
		errc <- err
	}()
	var ch chan tresult
	waitFor(t, "the request to wait", 5*time.Second, func() bool {
		tc.mu.Lock()
		defer tc.mu.Unlock()
		ch = tc.waiting[1]
		return ch != nil
	})
	// What the read loop does on ResponseStart, up to the hand-over.
	sb := newStreamBody(tc, 1, 1<<20)
	tc.mu.Lock()
	delete(tc.waiting, 1)
	tc.streams[1] = sb
	tc.mu.Unlock()
	cancel()
	time.Sleep(20 * time.Millisecond) // let the caller see its context end
	ch <- tresult{resp: hopmux.TunnelResponse{ID: 1, Status: 200}, stream: sb}
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("roundTrip: %v, want context.Canceled", err)
	}
	tc.mu.Lock()
	left := len(tc.streams)
	tc.mu.Unlock()
	if left != 0 {
		t.Fatal("the cancelled hop's stream is still registered on the tunnel")
	}
}

// The same over /ws: the relay's "registered" answer states its message
// limit, and a bridge answer that would exceed it becomes a 502 from the
// node instead of closing the bridge's connection.
func TestWSBridgeAnswerBeyondTheRelayLimit(t *testing.T) {
	testenv.CheckGoroutines(t)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Big") != "" {
			w.Write(make([]byte, 160<<10)) // 213 KiB of base64: over the relay's 149 KiB message limit
			return
		}
		TransformHandler(11).ServeHTTP(w, r)
	})
	tb := newTestbed(t, h, &Server{MaxFrameBytes: 64 << 10}, func(b *Bridge) { b.DisableTunnel = true })
	c := &Client{DisableTunnel: true}
	defer c.Close()
	big := hopReq(t, bf16Payload(1024), 1)
	big.Header.Set("X-Big", "1")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := c.Do(ctx, tb.relayAddr(), big)
	if err != nil {
		t.Fatalf("big answer: %v, want the node's 502", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("big answer: status %d, want 502", resp.StatusCode)
	}
	if n := metricValue(t, tb.relay, "meshgpu_relay_oversize_closes_total"); n != 0 {
		t.Fatalf("the relay closed %v connections for oversized messages", n)
	}
	payload := bf16Payload(1024)
	if st, _, body := doHop(t, c, tb.relayAddr(), payload, 1); st != 200 || !bytes.Equal(body, refTransform(payload)) {
		t.Fatal("hop after the big answer failed")
	}
}

// A tunnel peer that sends a malformed Hop frame (a head longer than its
// frame) loses its tunnel; the relay and other tunnels keep working.
func TestMalformedHopFrameClosesOnlyThatTunnel(t *testing.T) {
	testenv.CheckGoroutines(t)
	tb := newTestbed(t, nil, nil, nil)
	good := &Client{}
	defer good.Close()
	if st, _, _ := doHop(t, good, tb.relayAddr(), bf16Payload(1024), 1); st != 200 {
		t.Fatal("warm-up hop failed")
	}
	bad, _ := identity.New()
	tc, err := rawTunnel(t, tb.relayBase, bad, "", false)
	if err != nil {
		t.Fatal(err)
	}
	runErr := make(chan error, 1)
	go func() { runErr <- tc.run(context.Background()) }()
	// The routing prefix claims a peer id longer than the frame.
	frame := binary.BigEndian.AppendUint32([]byte{byte(hopmux.FrameHop)}, 9)
	frame = append(frame, binary.BigEndian.AppendUint64(nil, 1)...)
	frame = append(frame, 200)
	tc.c.send(outMsg{head: frame})
	select {
	case <-runErr:
	case <-time.After(5 * time.Second):
		t.Fatal("the relay kept a tunnel that sent a malformed Hop frame")
	}
	for i := 0; i < 3; i++ {
		if st, _, _ := doHop(t, good, tb.relayAddr(), bf16Payload(1024), 1); st != 200 {
			t.Fatal("healthy client's hop failed after another tunnel's malformed frame")
		}
	}
}

// The raw upgraded tunnel and the WebSocket tunnel carry the same frames:
// a client on each (and a bridge on each) gets byte-identical answers, and
// a client asking for the raw tunnel gets it from this relay.
func TestRawAndWebSocketTunnelsAgree(t *testing.T) {
	testenv.CheckGoroutines(t)
	tb := newTestbed(t, nil, nil, nil)
	raw, ws := &Client{}, &Client{WebSocketTunnel: true}
	defer raw.Close()
	defer ws.Close()
	payload := bf16Payload(2048)
	st1, h1, b1 := doHop(t, raw, tb.relayAddr(), payload, 1)
	st2, h2, b2 := doHop(t, ws, tb.relayAddr(), payload, 1)
	if st1 != 200 || st2 != 200 || !bytes.Equal(b1, b2) || h1.Get("X-Meshnet-Shape") != h2.Get("X-Meshnet-Shape") {
		t.Fatalf("raw %d %v, websocket %d %v: answers differ", st1, h1, st2, h2)
	}
	kinds := map[bool]bool{}
	for _, c := range []*Client{raw, ws} {
		c.mu.Lock()
		for _, slot := range c.tunnels {
			kinds[slot.t.c.raw != nil] = true
		}
		c.mu.Unlock()
	}
	if !kinds[true] || !kinds[false] {
		t.Fatalf("tunnel kinds in use: %v, want one raw and one WebSocket", kinds)
	}
	// A bridge on a WebSocket tunnel serves the same answers.
	id, _ := identity.New()
	b := &Bridge{RelayURL: tb.relayBase, Identity: id, Handler: TransformHandler(11), WebSocketTunnel: true,
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitFor(t, "websocket bridge connected", 5*time.Second, b.Connected)
	if cur := b.cur.Load(); cur == nil || cur.c.raw != nil {
		t.Fatal("the bridge did not keep to the WebSocket tunnel")
	}
	st3, _, b3 := doHop(t, raw, tb.relayBase+"/rpc/"+id.PeerID, payload, 1)
	if st3 != 200 || !bytes.Equal(b3, b1) {
		t.Fatalf("through a WebSocket bridge: %d, answers differ", st3)
	}
}

// Against a relay that predates the raw tunnel (its /tunnel answers the
// raw upgrade as gorilla answers any non-WebSocket request: 400), bridges
// and clients fall back to the WebSocket tunnel and hops still work.
func TestRawTunnelFallsBackToWebSocket(t *testing.T) {
	testenv.CheckGoroutines(t)
	s := &Server{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	h := s.Handler()
	old := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.EqualFold(r.Header.Get("Upgrade"), RawTunnelUpgrade) {
			http.Error(w, "Bad Request", http.StatusBadRequest)
			return
		}
		h.ServeHTTP(w, r)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: old, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan struct{})
	go func() { defer close(served); hs.Serve(ln) }()
	defer func() { s.Close(); hs.Close(); <-served }()
	base := "ws://" + ln.Addr().String()

	id, _ := identity.New()
	b := &Bridge{RelayURL: base, Identity: id, Handler: TransformHandler(11), MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitFor(t, "bridge connected", 5*time.Second, b.Connected)
	if b.Mode() != "tunnel" || b.cur.Load().c.raw != nil {
		t.Fatalf("bridge mode %q, raw %v: want the WebSocket tunnel", b.Mode(), b.cur.Load().c.raw != nil)
	}
	c := &Client{}
	defer c.Close()
	if st, _, body := doHop(t, c, base+"/rpc/"+id.PeerID, bf16Payload(1024), 1); st != 200 || len(body) != 2048 {
		t.Fatalf("hop through the old relay: %d, %d bytes", st, len(body))
	}
}
