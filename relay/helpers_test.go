package relay

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

func newTestbed(t *testing.T, h http.Handler, s *Server, tweak func(*Bridge)) *testbed {
	t.Helper()
	if h == nil {
		h = TransformHandler(11)
	}
	tb, err := startTestbed(h, s, tweak)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(tb.Close)
	return tb
}

// refTransform is the test's own statement of what TransformHandler must
// return, written from its doc comment (f64 math, explicit tie-to-even).
func refTransform(in []byte) []byte {
	out := make([]byte, len(in))
	for i := 0; i+1 < len(in); i += 2 {
		x := float64(math.Float32frombits(uint32(binary.LittleEndian.Uint16(in[i:])) << 16))
		y := float32(x*0.5 - 1) // exact in f32 for bf16 inputs of moderate range
		bits := math.Float32bits(y)
		hi, lo := bits>>16, bits&0xffff
		if lo > 0x8000 || lo == 0x8000 && hi&1 == 1 {
			hi++
		}
		binary.LittleEndian.PutUint16(out[i:], uint16(hi))
	}
	return out
}

// bf16Payload is n deterministic bf16 values, including ones that round.
func bf16Payload(n int) []byte {
	b := make([]byte, 2*n)
	for i := 0; i < n; i++ {
		f := float32(i%509)/37 - 6.5 + float32(i%3)*1e-3
		binary.LittleEndian.PutUint16(b[2*i:], uint16(math.Float32bits(f)>>16))
	}
	return b
}

func hopReq(t testing.TB, payload []byte, startLayer int) *http.Request {
	req, err := http.NewRequest(http.MethodPost, "http://node/forward", bytes.NewReader(payload))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-Meshnet-Session", "sess-1")
	req.Header.Set("X-Meshnet-Shape", "1,"+strconv.Itoa(len(payload)/2))
	req.Header.Set("X-Meshnet-Dtype", "bf16")
	req.Header.Set("X-Meshnet-Start-Layer", strconv.Itoa(startLayer))
	req.Header.Set("X-Meshnet-Position", "4")
	req.Header.Set("X-Meshnet-Route", `[{"endpoint":"","start_layer":6,"end_layer":11}]`)
	return req
}

// doHop sends one hop through c and returns status, headers and body.
func doHop(t testing.TB, c *Client, addr string, payload []byte, startLayer int) (int, http.Header, []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := c.Do(ctx, addr, hopReq(t, payload, startLayer))
	if err != nil {
		t.Fatalf("hop: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header, b
}

// metricValue reads a counter or gauge from the relay's registry; labels
// are "k=v" pairs that must all match.
func metricValue(t *testing.T, s *Server, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := s.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			if matchLabels(have, labels) {
				if m.Counter != nil {
					return m.Counter.GetValue()
				}
				if m.Gauge != nil {
					return m.Gauge.GetValue()
				}
			}
		}
	}
	return 0
}

func matchLabels(have map[string]string, want []string) bool {
	for _, kv := range want {
		k, v, _ := strings.Cut(kv, "=")
		if have[k] != v {
			return false
		}
	}
	return true
}

func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
