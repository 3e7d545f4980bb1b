package tracker

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"meshgpu/internal/testenv"
)

// A client that trickles a body to any tracker endpoint is cut off within
// BodyTimeout (408 or a closed connection), not held open.
func TestSlowBodyCutOff(t *testing.T) {
	testenv.CheckGoroutines(t)
	_, ts := startTracker(t, Config{BodyTimeout: time.Second})
	addr := strings.TrimPrefix(ts.URL, "http://")
	for _, path := range []string{"/register", "/heartbeat", "/v1/chat/completions", "/v1/completions", "/nodes", "/nowhere"} {
		took, code := testenv.SlowBody(t, addr, path, 200*time.Millisecond, 6*time.Second)
		if took > 3*time.Second || (code != 0 && code != http.StatusRequestTimeout && code != http.StatusMethodNotAllowed && code != http.StatusNotFound) {
			t.Errorf("%s: slow body answered %d after %v (deadline 1s)", path, code, took)
		}
		if (path == "/register" || path == "/v1/chat/completions") && code != http.StatusRequestTimeout {
			t.Errorf("%s: a handler that reads the body answered %d, want 408", path, code)
		}
	}
}
