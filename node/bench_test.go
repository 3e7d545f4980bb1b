package node

import (
	"context"
	"fmt"
	"io"
	"net"
	"slices"
	"testing"
	"time"

	"meshgpu/internal/latency"
	"meshgpu/native"
	"meshgpu/wire"
)

// BenchmarkHopLatency measures what the hop protocol adds per hop per token
// on loopback: the head's per-token hop (sendHop down a chain of 1-3 nodes
// whose stacks skip compute, the last one sampling from a tiny vocabulary)
// against a chain of raw TCP relays moving the same payload over persistent
// connections, measured in the same run. Reported: p50/p99 of both, and the
// p50 added per hop in µs.
func BenchmarkHopLatency(b *testing.B) {
	for _, hops := range []int{1, 2, 3} {
		for _, kib := range []int{4, 8} {
			b.Run(fmt.Sprintf("hops=%d/payload=%dKiB", hops, kib), func(b *testing.B) {
				benchHops(b, hops, kib<<10)
			})
		}
	}
}

func benchHops(b *testing.B, hops, payload int) {
	hidden := payload / 2 // one bf16 row
	const vocab = 16
	layers := hops + 1 // the head holds layer 0
	route := make([]wire.Hop, hops)
	for i := 0; i < hops; i++ {
		st := newFakeStack(i+1, i+1, layers, hidden, vocab)
		st.noop = true
		u := startNode(b, &Server{StackForTesting: st})
		route[i] = wire.Hop{Endpoint: u, StartLayer: i + 1, EndLayer: i + 1}
	}
	headStack := newFakeStack(0, 0, layers, hidden, vocab)
	headStack.noop = true
	head := &Server{StackForTesting: headStack, Logger: quietLogger()}
	head.Handler()
	b.Cleanup(func() { head.Close() })
	body := make([]byte, payload)
	ctx := context.Background()
	step := func(i int) {
		call := hopCall{session: "bench", nTokens: 1, hidden: hidden, dtype: native.BF16, pos: i % 200}
		res, ae := head.sendHop(ctx, route[0], route[1:], call, body, time.Time{})
		if ae != nil {
			b.Fatal(ae)
		}
		if res.token == nil {
			b.Fatal("no token from the chain")
		}
		res.done()
	}
	raw := newRawChain(b, hops, payload)
	for i := 0; i < 50; i++ { // warm connections and pools
		step(i)
		raw.roundTrip()
	}

	hopTimes := make([]time.Duration, 0, b.N)
	rawTimes := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		step(i)
		t1 := time.Now()
		raw.roundTrip()
		hopTimes = append(hopTimes, t1.Sub(t0))
		rawTimes = append(rawTimes, time.Since(t1))
	}
	b.StopTimer()
	hp50, hp99 := pct(hopTimes)
	rp50, rp99 := pct(rawTimes)
	b.ReportMetric(hp50, "hop-p50-µs")
	b.ReportMetric(hp99, "hop-p99-µs")
	b.ReportMetric(rp50, "raw-p50-µs")
	b.ReportMetric(rp99, "raw-p99-µs")
	b.ReportMetric((hp50-rp50)/float64(hops), "added-p50-µs/hop")
	b.ReportMetric((hp99-rp99)/float64(hops), "added-p99-µs/hop")
	b.ReportMetric(hp50/rp50, "ratio-p50")
}

func pct(d []time.Duration) (p50, p99 float64) {
	s := slices.Clone(d)
	slices.Sort(s)
	return float64(latency.Percentile(s, 0.50)) / 1e3, float64(latency.Percentile(s, 0.99)) / 1e3
}

// rawChain is the baseline: n TCP relays; each reads the payload, passes it
// to the next over a persistent connection, waits for its 16-byte answer
// and answers its caller (the last answers at once).
type rawChain struct {
	conn    net.Conn
	payload []byte
	reply   []byte
}

func newRawChain(b *testing.B, n, size int) *rawChain {
	next := ""
	for i := n - 1; i >= 0; i-- {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		down := next
		done := make(chan struct{})
		go func() {
			defer close(done)
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			var dc net.Conn
			if down != "" {
				if dc, err = net.Dial("tcp", down); err != nil {
					return
				}
				defer dc.Close()
			}
			buf := make([]byte, size)
			ans := make([]byte, 16)
			for {
				if _, err := io.ReadFull(c, buf); err != nil {
					return
				}
				if dc != nil {
					if _, err := dc.Write(buf); err != nil {
						return
					}
					if _, err := io.ReadFull(dc, ans); err != nil {
						return
					}
				}
				if _, err := c.Write(ans); err != nil {
					return
				}
			}
		}()
		b.Cleanup(func() { ln.Close(); <-done })
		next = ln.Addr().String()
	}
	c, err := net.Dial("tcp", next)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	return &rawChain{conn: c, payload: make([]byte, size), reply: make([]byte, 16)}
}

func (r *rawChain) roundTrip() {
	r.conn.Write(r.payload)
	io.ReadFull(r.conn, r.reply)
}
