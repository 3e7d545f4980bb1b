package relay

import (
	"context"
	"os"
	"testing"
)

// BenchmarkRelayHop runs BenchHops once per b.N round and reports the
// tunnel's and /rpc's p50 against direct HTTP and raw TCP from the same run.
func BenchmarkRelayHop(b *testing.B) {
	for i := 0; i < b.N; i++ {
		rep, err := BenchHops(context.Background(), BenchConfig{Hops: 400})
		if err != nil {
			b.Fatal(err)
		}
		if i == b.N-1 {
			for _, size := range []int{4096, 8192} {
				t, _ := rep.Get("tunnel", size)
				r, _ := rep.Get("rpc", size)
				d, _ := rep.Get("direct", size)
				tcp, _ := rep.Get("tcp", size)
				sfx := "-" + map[int]string{4096: "4KiB", 8192: "8KiB"}[size]
				b.ReportMetric(float64(t.P50-d.P50)/1e3, "tunnel-over-direct-us"+sfx)
				b.ReportMetric(float64(t.P50-tcp.P50)/1e3, "tunnel-over-tcp-us"+sfx)
				b.ReportMetric(float64(r.P50)/float64(t.P50), "rpc/tunnel"+sfx)
				b.ReportMetric(t.WireBytes, "tunnel-wire-B/hop"+sfx)
			}
			rep.Format(os.Stdout)
		}
	}
}
