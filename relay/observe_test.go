package relay

import (
	"net"
	"net/netip"
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
