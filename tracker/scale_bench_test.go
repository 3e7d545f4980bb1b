package tracker

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"sort"
	"sync"
	"testing"
	"time"

	"meshgpu/internal/testenv"
)

// BenchmarkRoute1000Nodes80Layers is issue 19's scale check: 1000 nodes
// over 80 layers register through the HTTP API, then GET /route is timed
// over HTTP, with the etcd store and, as the baseline of the same run, the
// in-memory store. Reports p50 and p99 per request (target p99 < 5 ms).
func BenchmarkRoute1000Nodes80Layers(b *testing.B) {
	for _, kind := range []string{"memory", "etcd"} {
		b.Run(kind, func(b *testing.B) {
			var store Store
			if kind == "etcd" {
				addr := testenv.Etcd(b)
				es, err := OpenEtcd(context.Background(), EtcdConfig{Endpoints: []string{addr}, TTL: 10 * time.Minute, Logger: quietLogger()})
				if err != nil {
					b.Fatal(err)
				}
				defer es.Close()
				store = es
			}
			srv := NewServer(Config{Store: store, HeartbeatTimeout: 10 * time.Minute, Logger: quietLogger(), Endpoints: AddrPolicy{AllowLoopback: true}, SkipEndpointCheck: true, RegisterPerIP: 1e9, RegisterIPBurst: 1e9, RegisterPerKey: 1e9, RegisterKeyBurst: 1e9})
			hs := &http.Server{Handler: srv.Handler()}
			ln := listenLocal(b)
			go hs.Serve(ln)
			defer hs.Close()
			base := "http://" + ln.Addr().String()
			tr := &http.Transport{MaxIdleConnsPerHost: 16}
			defer tr.CloseIdleConnections()
			hc := &http.Client{Transport: tr, Timeout: 30 * time.Second}

			start := time.Now()
			var wg sync.WaitGroup
			errs := make(chan error, 1000)
			sem := make(chan struct{}, 8)
			for i := 0; i < 1000; i++ {
				wg.Add(1)
				sem <- struct{}{}
				go func() {
					defer wg.Done()
					defer func() { <-sem }()
					first := (i * 8) % 80
					r := reg(fmt.Sprintf("http://127.0.0.1:%d", 10000+i), first, min(first+7+i%5, 79), 80, 0.5+float64(i%7)*0.25)
					c := &Client{URL: base, Identity: newIdentity(b), HTTP: hc}
					if _, err := c.Register(context.Background(), r); err != nil {
						errs <- err
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				b.Fatal(err)
			}
			regTime := time.Since(start)
			if n, _ := srv.Registry().Nodes(context.Background()); len(n) != 1000 {
				b.Fatalf("%d nodes registered", len(n))
			}
			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				resp, err := hc.Get(fmt.Sprintf("%s/route?model=gocoder-6m&seed=%d", base, i))
				if err != nil {
					b.Fatal(err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					b.Fatalf("route: %d", resp.StatusCode)
				}
				lat = append(lat, time.Since(t0))
			}
			b.StopTimer()
			sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
			pct := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))].Microseconds()) / 1000 }
			b.ReportMetric(pct(0.5), "p50-ms")
			b.ReportMetric(pct(0.99), "p99-ms")
			b.ReportMetric(regTime.Seconds(), "register-1000-s")
		})
	}
}

func listenLocal(tb testing.TB) net.Listener {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	return ln
}
