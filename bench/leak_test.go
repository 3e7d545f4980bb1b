package bench

import (
	"runtime"
	"testing"
	"time"
)

func goroutines() int { return runtime.NumGoroutine() }

// checkGoroutines fails t when goroutines started since before are still
// running after a short settle.
func checkGoroutines(t *testing.T, before int) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for {
		n := runtime.NumGoroutine()
		if n <= before {
			return
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<16)
			buf = buf[:runtime.Stack(buf, true)]
			t.Fatalf("%d goroutines before, %d after:\n%s", before, n, buf)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
