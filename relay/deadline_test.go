package relay

import (
	"io"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"meshgpu/internal/testenv"
)

// A client that trickles a request body is cut off within BodyTimeout, on
// every path of the relay.
func TestSlowBodyCutOff(t *testing.T) {
	testenv.CheckGoroutines(t)
	s := &Server{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), BodyTimeout: time.Second}
	ts := httptest.NewServer(s.Handler())
	defer ts.Close()
	defer s.Close()
	addr := strings.TrimPrefix(ts.URL, "http://")
	for _, path := range []string{"/ws", "/rpc/mg-x", "/health", "/nowhere"} {
		took, code := testenv.SlowBody(t, addr, path, 200*time.Millisecond, 6*time.Second)
		if took > 3*time.Second {
			t.Errorf("%s: slow body held %v (deadline 1s, status %d)", path, took, code)
		}
	}
}
