package relay_test

import (
	"context"
	"os"
	"testing"
	"time"

	"meshgpu/bench"
)

// BenchmarkRelayHop runs the `meshgpu bench hops` suite (bench.Hops: raw
// TCP, direct HTTP, /rpc and the tunnel to a real node.Server, interleaved
// hop by hop) once per b.N round, and reports the tunnel's and /rpc's p50
// against direct HTTP and raw TCP from the same run.
func BenchmarkRelayHop(b *testing.B) {
	benchRelayHop(b, bench.HopsConfig{N: 400})
}

// BenchmarkRelayHopWAN is the same suite across an emulated 20 ms round trip
// on every link, with TLS (https, wss): a relay on the internet, as ADR-0014
// deploys it. There the series differ by round trips per hop.
func BenchmarkRelayHopWAN(b *testing.B) {
	benchRelayHop(b, bench.HopsConfig{N: 30, Warmup: 3, RTT: 20 * time.Millisecond, TLS: true})
}

func benchRelayHop(b *testing.B, cfg bench.HopsConfig) {
	for i := 0; i < b.N; i++ {
		rep, err := bench.Hops(context.Background(), cfg)
		if err != nil {
			b.Fatal(err)
		}
		if i < b.N-1 {
			continue
		}
		for _, kib := range []float64{4, 8} {
			get := func(series string) bench.Row {
				row, ok := rep.Find(series, kib)
				if !ok {
					b.Fatalf("no %s row at %v KiB", series, kib)
				}
				return row
			}
			tun, rpc := get(bench.SeriesRelayTunnel), get(bench.SeriesRelayRPC)
			direct, tcp := get(bench.SeriesDirect), get(bench.SeriesRawTCP)
			sfx := map[float64]string{4: "-4KiB", 8: "-8KiB"}[kib]
			b.ReportMetric(tun.P50-direct.P50, "tunnel-over-direct-us"+sfx)
			b.ReportMetric(tun.P50-tcp.P50, "tunnel-over-tcp-us"+sfx)
			b.ReportMetric(tun.Extra["added_p50_floor"], "tunnel-over-floor-us"+sfx)
			b.ReportMetric(rpc.Extra["added_p50_floor"], "rpc-over-floor-us"+sfx)
			b.ReportMetric(rpc.P50/tun.P50, "rpc/tunnel"+sfx)
			b.ReportMetric(tun.Extra["wire_B"], "tunnel-wire-B/hop"+sfx)
		}
		rep.WriteTable(os.Stdout)
	}
}
