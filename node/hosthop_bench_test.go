package node

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"meshgpu/native"
	"meshgpu/wire"
)

// BenchmarkHostTimePerHop is the node's host-side time for one hop without
// network or compute: parse the request from memory (net/http's own
// parser), validate the headers, get a host buffer (the CPU backend's
// AllocHost, pinned on CUDA; or Go memory), read the body into it, run a
// no-op Forward in place, write the answer to a discarding writer. The
// baseline, timed in the same run, is the least any server does: read the
// same request bytes into a Go buffer and write the payload out; and a
// net/http floor: the same parse, the body read into a reused Go buffer and
// written back, nothing else. Reported: µs/hop, both baselines in µs and
// the ratios to them. Payloads: one token of the 1B and
// 8B shapes (bf16 hidden 2048 and 4096) and a 512-token 8B prefill.
func BenchmarkHostTimePerHop(b *testing.B) {
	for _, alloc := range []string{"backend", "go"} {
		for _, c := range []struct {
			name      string
			n, hidden int
		}{{"1B-decode", 1, 2048}, {"8B-decode", 1, 4096}, {"8B-prefill512", 512, 4096}} {
			b.Run(fmt.Sprintf("alloc=%s/%s", alloc, c.name), func(b *testing.B) {
				benchHostHop(b, alloc == "backend", c.n, c.hidden)
			})
		}
	}
}

// countingWriter is an http.ResponseWriter that counts and drops the body.
type countingWriter struct {
	h      http.Header
	status int
	n      int
}

func (w *countingWriter) Header() http.Header { return w.h }
func (w *countingWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
}
func (w *countingWriter) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	w.n += len(p)
	return io.Discard.Write(p)
}

func benchHostHop(b *testing.B, backend bool, n, hidden int) {
	st := newFakeStack(1, 2, 4, hidden, 16)
	st.noop = true
	st.cfg.MaxContext = 1024
	s := &Server{StackForTesting: st, Logger: quietLogger()}
	if backend {
		be, err := native.Open("cpu", native.Options{Threads: 1})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { be.Close() })
		s.Backend = be
	}
	h := s.Handler()
	b.Cleanup(func() { s.Close() })

	payload := n * hidden * 2
	var raw bytes.Buffer
	fmt.Fprintf(&raw, "POST /forward HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"+
		"Content-Length: %d\r\n%s: bench\r\n%s: %d,%d\r\n%s: bf16\r\n%s: 1\r\n%s: 2\r\n%s: 0\r\n\r\n",
		payload, wire.HeaderSession, wire.HeaderShape, n, hidden, wire.HeaderDType, wire.HeaderStartLayer, wire.HeaderEndLayer, wire.HeaderPosition)
	raw.Write(make([]byte, payload))
	wire := raw.Bytes()
	src := bytes.NewReader(wire)
	br := bufio.NewReaderSize(src, 64<<10)
	w := &countingWriter{h: http.Header{}}

	hop := func() {
		src.Reset(wire)
		br.Reset(src)
		req, err := http.ReadRequest(br)
		if err != nil {
			b.Fatal(err)
		}
		clear(w.h)
		w.status, w.n = 0, 0
		h.ServeHTTP(w, req)
		if w.status != http.StatusOK || w.n != payload {
			b.Fatalf("hop answered %d with %d bytes", w.status, w.n)
		}
	}
	// Baseline: the request's bytes into a Go buffer, the payload out.
	buf := make([]byte, len(wire))
	baseline := func() {
		src.Reset(wire)
		br.Reset(src)
		if _, err := io.ReadFull(br, buf); err != nil {
			b.Fatal(err)
		}
		io.Discard.Write(buf[len(wire)-payload:])
	}
	// net/http floor: the same parse and a handler that only reads the
	// body into a reused Go buffer and writes it back.
	body := make([]byte, payload)
	plain := func() {
		src.Reset(wire)
		br.Reset(src)
		req, err := http.ReadRequest(br)
		if err != nil {
			b.Fatal(err)
		}
		clear(w.h)
		w.status, w.n = 0, 0
		if _, err := io.ReadFull(req.Body, body); err != nil {
			b.Fatal(err)
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Write(body)
	}
	for i := 0; i < 20; i++ { // warm the pool and the session
		hop()
		baseline()
		plain()
	}
	b.ResetTimer()
	t0 := time.Now()
	for i := 0; i < b.N; i++ {
		hop()
	}
	hopT := time.Since(t0)
	b.StopTimer()
	t1 := time.Now()
	for i := 0; i < b.N; i++ {
		baseline()
	}
	baseT := time.Since(t1)
	t2 := time.Now()
	for i := 0; i < b.N; i++ {
		plain()
	}
	plainT := time.Since(t2)
	us := func(d time.Duration) float64 { return float64(d) / float64(b.N) / 1e3 }
	b.ReportMetric(us(hopT), "µs/hop")
	b.ReportMetric(us(baseT), "baseline-µs")
	b.ReportMetric(us(plainT), "nethttp-µs")
	b.ReportMetric(float64(hopT)/float64(baseT), "ratio")
	b.ReportMetric(float64(hopT)/float64(plainT), "ratio-nethttp")
	b.ReportMetric(float64(payload), "payload-bytes")
}
