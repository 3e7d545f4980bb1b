package relay

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"strconv"
	"time"

	"meshgpu/identity"
)

// The in-process testbed the relay tests share: a relay, a bridged node and
// a direct HTTP server, all on loopback. The hop benchmark that used to live
// beside it is bench.Hops (meshgpu bench hops), which BenchmarkRelayHop calls.

// TransformHandler stands in for a node's /forward: it checks the hop
// headers and answers bf16 activations out[i] = bf16(in[i]*0.5 - 1), or, when
// X-Meshnet-Start-Layer equals lastLayer, a last-hop JSON decode answer.
func TransformHandler(lastLayer int) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fail := func(code int, msg string) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(code)
			json.NewEncoder(w).Encode(errorBody("bad_request", msg, ""))
		}
		if r.Method != http.MethodPost || r.URL.Path != "/forward" {
			fail(http.StatusNotFound, "only POST /forward")
			return
		}
		if r.Header.Get("X-Meshnet-Session") == "" {
			fail(http.StatusBadRequest, "X-Meshnet-Session is required")
			return
		}
		var n, hidden int
		if _, err := fmt.Sscanf(r.Header.Get("X-Meshnet-Shape"), "%d,%d", &n, &hidden); err != nil || n <= 0 || hidden <= 0 {
			fail(http.StatusBadRequest, "X-Meshnet-Shape must be n_tokens,hidden")
			return
		}
		start, err := strconv.Atoi(r.Header.Get("X-Meshnet-Start-Layer"))
		if err != nil {
			fail(http.StatusBadRequest, "X-Meshnet-Start-Layer must be an integer")
			return
		}
		body, err := io.ReadAll(io.LimitReader(r.Body, int64(2*n*hidden)+1))
		if err != nil || len(body) != 2*n*hidden {
			fail(http.StatusBadRequest, "body length does not match X-Meshnet-Shape (bf16)")
			return
		}
		if start == lastLayer {
			var sum uint32
			for i := 0; i+1 < len(body); i += 2 {
				sum += uint32(binary.LittleEndian.Uint16(body[i:]))
			}
			w.Header().Set("Content-Type", "application/json")
			json.NewEncoder(w).Encode(map[string]any{"token": sum % 50000, "text": "tok\u00e9\"" + strconv.Itoa(int(sum%97)), "logprob": -0.125})
			return
		}
		out := make([]byte, len(body))
		for i := 0; i+1 < len(body); i += 2 {
			f := math.Float32frombits(uint32(binary.LittleEndian.Uint16(body[i:])) << 16)
			binary.LittleEndian.PutUint16(out[i:], bf16RNE(f*0.5-1))
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("X-Meshnet-Shape", fmt.Sprintf("%d,%d", n, hidden))
		w.Header().Set("X-Meshnet-Dtype", "bf16")
		w.Header().Set("X-Meshnet-End-Layer", strconv.Itoa(start))
		w.Write(out)
	})
}

// bf16RNE rounds f32 to bf16, nearest even (NaN stays NaN).
func bf16RNE(f float32) uint16 {
	b := math.Float32bits(f)
	if f != f {
		return uint16(b>>16) | 0x40
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// testbed is a relay, a node bridged to it and the same handler served
// directly over HTTP, all on 127.0.0.1.
type testbed struct {
	relay      *Server
	relaySrv   *http.Server
	relayLn    net.Listener
	relayBase  string // ws://127.0.0.1:port
	bridge     *Bridge
	bridgeErr  chan error
	cancel     context.CancelFunc
	direct     *http.Server
	directURL  string
	directDone chan struct{}
	relayDone  chan struct{}
}

func (tb *testbed) relayAddr() string { return tb.relayBase + "/rpc/" + tb.bridge.Identity.PeerID }

// startTestbed starts s (nil: defaults) and a bridge serving h; tweak may
// adjust the bridge before it starts.
func startTestbed(h http.Handler, s *Server, tweak func(*Bridge)) (*testbed, error) {
	if s == nil {
		s = &Server{}
	}
	if s.Logger == nil {
		s.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	tb := &testbed{relay: s, relayDone: make(chan struct{}), directDone: make(chan struct{})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	tb.relayLn = ln
	tb.relayBase = "ws://" + ln.Addr().String()
	tb.relaySrv = &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 5 * time.Second}
	go func() { defer close(tb.relayDone); tb.relaySrv.Serve(ln) }()

	dln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.closeRelay()
		return nil, err
	}
	tb.directURL = "http://" + dln.Addr().String()
	tb.direct = &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	go func() { defer close(tb.directDone); tb.direct.Serve(dln) }()

	id, err := identity.New()
	if err != nil {
		tb.Close()
		return nil, err
	}
	tb.bridge = &Bridge{RelayURL: tb.relayBase, Identity: id, Handler: h, Logger: s.Logger,
		MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, JoinToken: s.JoinToken}
	if tweak != nil {
		tweak(tb.bridge)
	}
	ctx, cancel := context.WithCancel(context.Background())
	tb.cancel = cancel
	tb.bridgeErr = make(chan error, 1)
	go func() { tb.bridgeErr <- tb.bridge.Run(ctx) }()
	deadline := time.Now().Add(10 * time.Second)
	for !tb.bridge.Connected() || !tb.relay.hasPeer(id.PeerID) {
		if time.Now().After(deadline) {
			tb.Close()
			return nil, errors.New("bridge did not connect to the relay within 10s")
		}
		time.Sleep(2 * time.Millisecond)
	}
	return tb, nil
}

func (s *Server) hasPeer(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.peers[id] != nil
}

func (tb *testbed) closeRelay() {
	tb.relay.Close()
	tb.relaySrv.Close()
	<-tb.relayDone
}

// Close stops the bridge, the relay and the direct server, waiting for all.
func (tb *testbed) Close() {
	if tb.cancel != nil {
		tb.cancel()
		<-tb.bridgeErr
	}
	tb.closeRelay()
	if tb.direct != nil {
		tb.direct.Close()
		<-tb.directDone
	}
}
