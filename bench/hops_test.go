package bench

import (
	"context"
	"math"
	"path/filepath"
	"testing"
	"time"
)

func TestHopsSuite(t *testing.T) {
	before := goroutines()
	rep, err := Hops(context.Background(), HopsConfig{N: 30, Warmup: 5})
	if err != nil {
		t.Fatal(err)
	}
	for _, kib := range []float64{4, 8} {
		tcp, ok := rep.Find(SeriesRawTCP, kib)
		if !ok {
			t.Fatalf("no raw-tcp row at %v KiB", kib)
		}
		for _, s := range HopSeries {
			row, ok := rep.Find(s, kib)
			if !ok || row.N != 30 {
				t.Fatalf("series %s at %v KiB: %+v", s, kib, row)
			}
			// Every hop carries at least the payload there and back.
			if w := row.Extra["wire_B"]; w < 2*kib*1024 {
				t.Errorf("%s %v KiB: %v bytes on the wire per hop, less than the payload both ways", s, kib, w)
			}
			if s != SeriesRawTCP && row.P50 <= tcp.P50/2 {
				t.Errorf("%s p50 %.1f µs is far below raw TCP's %.1f µs: the timing is broken", s, row.P50, tcp.P50)
			}
		}
		// The relay's costs are also stated against direct HTTP and the
		// tunnel (what BenchmarkRelayHop and the docs' Relay section report);
		// they must agree with the rows they come from.
		direct, _ := rep.Find(SeriesDirect, kib)
		tun, _ := rep.Find(SeriesRelayTunnel, kib)
		for _, s := range HopSeries {
			row, _ := rep.Find(s, kib)
			got, ok := row.Extra["added_p50_direct"]
			if s == SeriesRawTCP {
				if ok {
					t.Errorf("raw-tcp has added_p50_direct %v; it is the floor, not a hop", got)
				}
				continue
			}
			if !ok || math.Abs(got-(row.P50-direct.P50)) > 1e-9 {
				t.Errorf("%s %v KiB: added_p50_direct %v (present %v), rows say %v", s, kib, got, ok, row.P50-direct.P50)
			}
		}
		rpc, _ := rep.Find(SeriesRelayRPC, kib)
		for _, row := range []Row{rpc, tun} {
			if got := row.Extra["added_p50_floor"]; math.Abs(got-(row.P50-2*tcp.P50)) > 1e-9 {
				t.Errorf("%s %v KiB: added_p50_floor %v, rows say %v", row.Series, kib, got, row.P50-2*tcp.P50)
			}
		}
		if got := rpc.Extra["p50_per_tunnel"]; math.Abs(got-rpc.P50/tun.P50) > 1e-9 {
			t.Errorf("%v KiB: p50_per_tunnel %v, rows say %v", kib, got, rpc.P50/tun.P50)
		}
		// Raw TCP sends exactly a 4-byte length and the payload each way.
		if w := tcp.Extra["wire_B"]; w != 2*(4+kib*1024) {
			t.Errorf("raw-tcp wire bytes %v, want %v", w, 2*(4+kib*1024))
		}
	}
	path := filepath.Join(t.TempDir(), "hops.svg")
	if err := rep.Plot(path); err != nil {
		t.Fatal(err)
	}
	CheckSVGSeries(t, path, HopSeries...)
	checkGoroutines(t, before)
}

// Over a link with a real round-trip time the series differ by round trips,
// not microseconds: a direct hop waits for one, the tunnel for two (client to
// relay, relay to node, both kept open), and /rpc for a TCP connect, a TLS
// handshake and a WebSocket upgrade before those two. This checks the
// protocols' structure (a tunnel that redialled per hop would fail it), with
// a link slow enough that scheduling noise is a small fraction of an RTT.
func TestHopsRoundTripsOverTLSLink(t *testing.T) {
	if testing.Short() {
		t.Skip("waits about 200 round trips of 15 ms")
	}
	before := goroutines()
	const rtt = 15 * time.Millisecond
	rep, err := Hops(context.Background(), HopsConfig{N: 8, Warmup: 2, PayloadKiB: []int{8}, RTT: rtt, TLS: true})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][2]float64{ // round trips per hop: [min, max)
		SeriesRawTCP:      {1, 1.6},
		SeriesDirect:      {1, 1.6},
		SeriesRelayTunnel: {2, 2.6},
		SeriesRelayRPC:    {5, 6.6},
	}
	for s, w := range want {
		row, ok := rep.Find(s, 8)
		if !ok {
			t.Fatalf("no %s row", s)
		}
		got := row.Extra["round_trips"]
		if math.Abs(got-row.P50/float64(rtt.Microseconds())) > 1e-9 {
			t.Errorf("%s: round_trips %v disagrees with p50 %v µs over %v", s, got, row.P50, rtt)
		}
		if got < w[0] || got >= w[1] {
			t.Errorf("%s: p50 %.1f ms is %.2f round trips of %v, want %v to %v", s, row.P50/1e3, got, rtt, w[0], w[1])
		}
	}
	checkGoroutines(t, before)
}
