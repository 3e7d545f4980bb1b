package relay

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"meshgpu/wire"
)

// The observation port tells a node the address its probe came from, and
// reflects nothing at a forged source larger than what it was sent: a
// probe shorter than wire.PathProbeLen (an attacker's, to amplify) gets no
// answer, and an answer is never longer than its probe.
func TestObservationPortAnswersOnlyFullProbes(t *testing.T) {
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- (&Observer{}).Serve(pc) }()
	defer func() { pc.Close(); <-done }()
	c, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	id := wire.PathID{1, 2, 3}
	probe := wire.AppendPathProbe(nil, id)
	buf := make([]byte, 1500)
	// A short probe (the id, but not the padding) gets no answer.
	c.WriteTo(probe[:wire.PathProbeLen-1], pc.LocalAddr())
	c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, _, err := c.ReadFrom(buf); err == nil {
		t.Fatalf("a %d-byte probe got a %d-byte answer", wire.PathProbeLen-1, n)
	}
	c.WriteTo(probe, pc.LocalAddr())
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, _, err := c.ReadFrom(buf)
	if err != nil {
		t.Fatal(err)
	}
	kind, got, addr, err := wire.ParsePathPacket(buf[:n])
	want := c.LocalAddr().(*net.UDPAddr).AddrPort()
	if err != nil || kind != wire.PathObserved || got != id || addr != netip.AddrPortFrom(want.Addr().Unmap(), want.Port()) {
		t.Fatalf("answer %v %v %v %v, want the probe's id and %v", kind, got, addr, err, want)
	}
	if n > len(probe) {
		t.Fatalf("a %d-byte answer to a %d-byte probe", n, len(probe))
	}
}

// A flood of probes (forged sources would aim their answers at a victim)
// gets at most MaxPerSecond answers a second in all; the rest count as
// limited.
func TestObservationPortLimitsAnswers(t *testing.T) {
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	const rate = 20
	o := &Observer{MaxPerSecond: rate}
	o.init() // the counter exists before Serve runs, so reading it below is ordered after its creation
	done := make(chan error, 1)
	go func() { done <- o.Serve(pc) }()
	defer func() { pc.Close(); <-done }()
	c, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetReadBuffer(1 << 20)
	const probes = 200
	start := time.Now()
	for i := range probes {
		c.WriteTo(wire.AppendPathProbe(nil, wire.PathID{byte(i), byte(i >> 8)}), pc.LocalAddr())
	}
	answers := 0
	buf := make([]byte, 1500)
	for {
		c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		if _, _, err := c.ReadFrom(buf); err != nil {
			break
		}
		answers++
	}
	// The bucket starts full (rate) and refills at rate a second.
	allowed := rate + int(time.Since(start).Seconds()*rate) + 1
	if answers == 0 || answers > allowed {
		t.Fatalf("%d answers to %d probes in %v, want 1 to %d", answers, probes, time.Since(start), allowed)
	}
	if got := testutil.ToFloat64(o.counter.WithLabelValues("limited")); got == 0 {
		t.Fatal("no probe counted as limited")
	}
}

// GET /observe tells a TCP connection the address it comes from, and
// answers at most ObserveRate a second in all: the rest get 429 JSON and
// the relay keeps serving.
func TestTCPObservationAnswersAndLimits(t *testing.T) {
	const rate = 20
	s := &Server{ObserveRate: rate, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	ts := httptest.NewServer(s.Handler())
	defer ts.Close()
	defer s.Close()
	// The answer names the connection's own address.
	c, err := net.Dial("tcp", ts.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: relay\r\n\r\n", wire.ObservePath)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	var obs wire.ObservedAddr
	json.NewDecoder(resp.Body).Decode(&obs)
	resp.Body.Close()
	c.Close()
	if resp.StatusCode != http.StatusOK || obs.Addr != c.LocalAddr().String() {
		t.Fatalf("GET /observe from %s: %d %q", c.LocalAddr(), resp.StatusCode, obs.Addr)
	}
	const asks = 200
	start := time.Now()
	var wg sync.WaitGroup
	var mu sync.Mutex
	codes := map[int]int{}
	for range asks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Get(ts.URL + wire.ObservePath)
			if err != nil {
				t.Error(err)
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusTooManyRequests && !strings.Contains(string(b), `"type":"rate_limited"`) {
				t.Errorf("429 without its JSON error: %s", b)
			}
			mu.Lock()
			codes[resp.StatusCode]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	allowed := rate + int(time.Since(start).Seconds()*rate) + 1 // the first one's token is back by now at most
	if codes[http.StatusOK] == 0 || codes[http.StatusOK] > allowed || codes[http.StatusOK]+codes[http.StatusTooManyRequests] != asks {
		t.Fatalf("%v to %d observations in %v, want 1 to %d answered, the rest 429", codes, asks, time.Since(start), allowed)
	}
	if resp, err := http.Get(ts.URL + "/health"); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("the relay after the observations: %v %v", resp, err)
	}
}
