package node

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"meshgpu/native"
	"meshgpu/wire"
)

// quietLogger keeps test output readable; MESHGPU_TEST_LOG is not needed.
func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// serve runs h on a real 127.0.0.1 listener until the test ends.
func serve(t testing.TB, h http.Handler) (url string, stop func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() { hs.Serve(ln); close(done) }()
	var stopped bool
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if hs.Shutdown(ctx) != nil {
			hs.Close()
		}
		<-done
	}
	t.Cleanup(stop)
	return "http://" + ln.Addr().String(), stop
}

// startNode serves s; the server is closed when the test ends.
func startNode(t testing.TB, s *Server) string {
	t.Helper()
	if s.Logger == nil {
		s.Logger = quietLogger()
	}
	url, _ := serve(t, s.Handler())
	t.Cleanup(func() { s.Close() })
	return url
}

// hopReq is a test hop.
type hopReq struct {
	session         string
	n, hidden       int
	dtype           native.DType
	start, end, pos int
	route           []wire.Hop
	sampling        string
	body            []byte // nil: rows of embedded tokens
	tokens          []int32
	header          map[string]string // overrides
}

func (h hopReq) send(t testing.TB, c *http.Client, base string) (int, http.Header, []byte) {
	t.Helper()
	body := h.body
	if body == nil {
		body = make([]byte, h.n*h.hidden*h.dtype.Size())
		for i := 0; i < h.n; i++ {
			tok := int32(i)
			if i < len(h.tokens) {
				tok = h.tokens[i]
			}
			for j := 0; j < h.hidden; j++ {
				put(body, h.dtype, i*h.hidden+j, float32(tok))
			}
		}
	}
	req, _ := http.NewRequest(http.MethodPost, base+"/forward", bytes.NewReader(body))
	req.Header.Set(wire.HeaderSession, h.session)
	req.Header.Set(wire.HeaderShape, strconv.Itoa(h.n)+","+strconv.Itoa(h.hidden))
	req.Header.Set(wire.HeaderDType, h.dtype.String())
	req.Header.Set(wire.HeaderStartLayer, strconv.Itoa(h.start))
	if h.end >= 0 {
		req.Header.Set(wire.HeaderEndLayer, strconv.Itoa(h.end))
	}
	req.Header.Set(wire.HeaderPosition, strconv.Itoa(h.pos))
	if len(h.route) > 0 {
		b, _ := json.Marshal(h.route)
		req.Header.Set(wire.HeaderRoute, string(b))
	}
	if h.sampling != "" {
		req.Header.Set(wire.HeaderSampling, h.sampling)
	}
	for k, v := range h.header {
		if v == "" {
			req.Header.Del(k)
		} else {
			req.Header.Set(k, v)
		}
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("hop: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, b
}

// decodeError checks an error body's shape and returns it.
func decodeError(t testing.TB, status int, h http.Header, b []byte) *apiError {
	t.Helper()
	if !strings.HasPrefix(h.Get("Content-Type"), "application/json") {
		t.Fatalf("error %d with Content-Type %q: %s", status, h.Get("Content-Type"), b)
	}
	var eb errorBody
	if err := json.Unmarshal(b, &eb); err != nil || eb.Error == nil || eb.Error.Message == "" || eb.Error.Type == "" {
		t.Fatalf("error %d body is not {\"error\":{message,type}}: %s", status, b)
	}
	eb.Error.Status = status
	return fromWire(eb.Error)
}

func getJSON(t testing.TB, c *http.Client, url string, v any) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("GET %s: %d %s", url, resp.StatusCode, b)
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
}

func sessionsOn(t testing.TB, c *http.Client, base string) int {
	var h Health
	getJSON(t, c, base+"/health", &h)
	return h.Sessions
}

// waitSessions waits until every node holds no session.
func waitSessions(t testing.TB, c *http.Client, bases ...string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		busy := ""
		for _, b := range bases {
			if n := sessionsOn(t, c, b); n != 0 {
				busy = b + " holds " + strconv.Itoa(n)
			}
		}
		if busy == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("sessions not freed: %s", busy)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
