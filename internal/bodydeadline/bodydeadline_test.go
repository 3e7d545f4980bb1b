package bodydeadline

import (
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"meshgpu/internal/testenv"
)

func serve(t *testing.T, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: h}
	done := make(chan struct{})
	go func() { defer close(done); hs.Serve(ln) }()
	t.Cleanup(func() { hs.Close(); <-done })
	return ln.Addr().String()
}

func reader(w http.ResponseWriter, r *http.Request) {
	_, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), Status(err))
		return
	}
	// A slow response after the body: the deadline must not cut it.
	time.Sleep(600 * time.Millisecond)
	io.WriteString(w, "ok")
}

func TestSlowBodyIsCutOff(t *testing.T) {
	testenv.CheckGoroutines(t)
	addr := serve(t, Middleware(500*time.Millisecond, http.HandlerFunc(reader)))
	took, code := testenv.SlowBody(t, addr, "/", 200*time.Millisecond, 5*time.Second)
	if code != 0 && code != http.StatusRequestTimeout {
		t.Fatalf("status %d, want 408 or a closed connection", code)
	}
	if took > 2*time.Second {
		t.Fatalf("cut off after %v, deadline 500ms", took)
	}
	// A handler that never reads the body: the server's own drain of the
	// body hits the deadline too.
	addr = serve(t, Middleware(500*time.Millisecond, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "no", 405)
	})))
	took, _ = testenv.SlowBody(t, addr, "/", 200*time.Millisecond, 5*time.Second)
	if took > 2*time.Second {
		t.Fatalf("unread body: connection held %v", took)
	}
}

// The deadline covers the body only: a response that takes longer than it
// after the body is in still arrives.
func TestDeadlineClearedAfterBody(t *testing.T) {
	testenv.CheckGoroutines(t)
	addr := serve(t, Middleware(300*time.Millisecond, http.HandlerFunc(reader)))
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	for i := 0; i < 2; i++ { // the second on the kept-alive connection
		resp, err := (&http.Client{Transport: tr}).Post("http://"+addr+"/", "text/plain", strings.NewReader("body"))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || string(b) != "ok" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, b)
		}
	}
}
