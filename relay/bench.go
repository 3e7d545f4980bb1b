package relay

import (
	"bytes"
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
	"sort"
	"strconv"
	"text/tabwriter"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/wirecount"
)

// This file is the hop benchmark (BenchHops, used by BenchmarkRelayHop and
// `meshgpu bench hops`) and the in-process testbed it shares with the
// tests: a relay, a bridged node and a direct HTTP server, all on loopback.

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

// BenchConfig sizes BenchHops.
type BenchConfig struct {
	Hops   int   // measured hops per mode and size (default 500)
	Warmup int   // unmeasured hops first (default 50)
	Sizes  []int // payload bytes (default 4096 and 8192: bf16 hidden 2048 and 4096)
}

// HopStats is one mode and payload size.
type HopStats struct {
	Mode         string // tcp, direct, rpc, tunnel
	PayloadBytes int
	P50, P99     time.Duration
	WireBytes    float64 // client-side bytes on the wire per hop, both directions
}

// BenchReport is BenchHops' result.
type BenchReport struct {
	Stats []HopStats
}

// Get returns the stats of mode at size.
func (r *BenchReport) Get(mode string, size int) (HopStats, bool) {
	for _, s := range r.Stats {
		if s.Mode == mode && s.PayloadBytes == size {
			return s, true
		}
	}
	return HopStats{}, false
}

// Format writes the table: absolute p50/p99, p50 added over raw TCP and over
// direct HTTP, /rpc over tunnel ratio, and wire bytes per hop.
func (r *BenchReport) Format(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\tpayload\tp50 us\tp99 us\t+p50 vs tcp us\t+p50 vs direct us\twire B/hop\t")
	us := func(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/1e3) }
	for _, s := range r.Stats {
		tcp, _ := r.Get("tcp", s.PayloadBytes)
		direct, _ := r.Get("direct", s.PayloadBytes)
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%.0f\t\n", s.Mode, s.PayloadBytes, us(s.P50), us(s.P99),
			us(s.P50-tcp.P50), us(s.P50-direct.P50), s.WireBytes)
	}
	tw.Flush()
	for _, s := range r.Stats {
		if s.Mode != "tunnel" {
			continue
		}
		rpc, _ := r.Get("rpc", s.PayloadBytes)
		if s.P50 > 0 {
			fmt.Fprintf(w, "payload %d: /rpc p50 is %.1fx the tunnel's\n", s.PayloadBytes, float64(rpc.P50)/float64(s.P50))
		}
	}
}

// BenchHops measures per-hop latency on loopback for raw TCP (a length-
// prefixed echo: the floor), direct HTTP to the handler, ADR-0014 /rpc
// through a relay, and the tunnel through a relay, all in one process and
// one run, so the ratios are comparable.
func BenchHops(ctx context.Context, cfg BenchConfig) (*BenchReport, error) {
	if cfg.Hops <= 0 {
		cfg.Hops = 500
	}
	if cfg.Warmup <= 0 {
		cfg.Warmup = 50
	}
	if len(cfg.Sizes) == 0 {
		cfg.Sizes = []int{4096, 8192}
	}
	tb, err := startTestbed(TransformHandler(-1), nil, nil)
	if err != nil {
		return nil, err
	}
	defer tb.Close()
	rep := &BenchReport{}
	for _, size := range cfg.Sizes {
		if size <= 0 || size%2 != 0 {
			return nil, fmt.Errorf("payload size %d must be a positive even number of bytes (bf16)", size)
		}
		for _, mode := range []string{"tcp", "direct", "rpc", "tunnel"} {
			st, err := benchMode(ctx, tb, mode, size, cfg)
			if err != nil {
				return nil, fmt.Errorf("%s %d B: %w", mode, size, err)
			}
			rep.Stats = append(rep.Stats, st)
		}
	}
	return rep, nil
}

// hopFunc runs one hop.
type hopFunc func(ctx context.Context) error

func benchMode(ctx context.Context, tb *testbed, mode string, size int, cfg BenchConfig) (HopStats, error) {
	var wc wirecount.Counter
	payload := make([]byte, size)
	for i := 0; i+1 < size; i += 2 {
		binary.LittleEndian.PutUint16(payload[i:], bf16RNE(float32(i%251)/64-1))
	}
	hop, cleanup, err := makeHop(tb, mode, payload, &wc)
	if err != nil {
		return HopStats{}, err
	}
	defer cleanup()
	for i := 0; i < cfg.Warmup; i++ {
		if err := hop(ctx); err != nil {
			return HopStats{}, err
		}
	}
	wc.Reset()
	lat := make([]time.Duration, cfg.Hops)
	for i := range lat {
		t0 := time.Now()
		if err := hop(ctx); err != nil {
			return HopStats{}, err
		}
		lat[i] = time.Since(t0)
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	return HopStats{Mode: mode, PayloadBytes: size, P50: lat[len(lat)/2], P99: lat[len(lat)*99/100],
		WireBytes: float64(wc.Bytes()) / float64(cfg.Hops)}, nil
}

func hopRequest(ctx context.Context, url string, payload []byte) *http.Request {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(payload))
	req.Header.Set("X-Meshnet-Session", "bench")
	req.Header.Set("X-Meshnet-Shape", "1,"+strconv.Itoa(len(payload)/2))
	req.Header.Set("X-Meshnet-Dtype", "bf16")
	req.Header.Set("X-Meshnet-Start-Layer", "3")
	req.Header.Set("X-Meshnet-Position", "17")
	req.Header.Set("Content-Type", "application/octet-stream")
	return req
}

func checkHop(resp *http.Response, want int) error {
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK || len(b) != want {
		return fmt.Errorf("hop answered %d with %d bytes: %.200s", resp.StatusCode, len(b), b)
	}
	return nil
}

func makeHop(tb *testbed, mode string, payload []byte, wc *wirecount.Counter) (hopFunc, func(), error) {
	switch mode {
	case "tcp":
		return tcpEchoHop(payload, wc)
	case "direct":
		tr := &http.Transport{DialContext: wc.Dial, MaxIdleConnsPerHost: 4}
		hc := &http.Client{Transport: tr}
		return func(ctx context.Context) error {
			resp, err := hc.Do(hopRequest(ctx, tb.directURL+"/forward", payload))
			if err != nil {
				return err
			}
			return checkHop(resp, len(payload))
		}, tr.CloseIdleConnections, nil
	case "rpc", "tunnel":
		c := &Client{DisableTunnel: mode == "rpc", NetDialContext: wc.Dial}
		addr := tb.relayAddr()
		return func(ctx context.Context) error {
			req := hopRequest(ctx, "http://node/forward", payload)
			resp, err := c.Do(ctx, addr, req)
			if err != nil {
				return err
			}
			return checkHop(resp, len(payload))
		}, func() { c.Close() }, nil
	}
	return nil, nil, fmt.Errorf("unknown mode %q", mode)
}

// tcpEchoHop is the floor: a length-prefixed payload to an echo server
// and back over one kept-alive loopback connection.
func tcpEchoHop(payload []byte, wc *wirecount.Counter) (hopFunc, func(), error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, 4+len(payload))
		for {
			c.SetDeadline(time.Now().Add(30 * time.Second))
			if _, err := io.ReadFull(c, buf); err != nil {
				return
			}
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	}()
	c, err := wc.Dial(context.Background(), "tcp", ln.Addr().String())
	if err != nil {
		ln.Close()
		<-done
		return nil, nil, err
	}
	msg := binary.BigEndian.AppendUint32(nil, uint32(len(payload)))
	msg = append(msg, payload...)
	in := make([]byte, len(msg))
	hop := func(ctx context.Context) error {
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Write(msg); err != nil {
			return err
		}
		_, err := io.ReadFull(c, in)
		return err
	}
	return hop, func() { c.Close(); ln.Close(); <-done }, nil
}
