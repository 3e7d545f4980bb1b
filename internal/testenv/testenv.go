// Package testenv finds the shared test data (../shared beside the checkout)
// and skips tests with a clear message when it is absent.
package testenv

import (
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"
)

// RepoRoot is the directory holding go.mod.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// SharedDir is $MESHGPU_SHARED or ../shared beside the checkout.
func SharedDir() string {
	if d := os.Getenv("MESHGPU_SHARED"); d != "" {
		return d
	}
	return filepath.Join(RepoRoot(), "..", "shared")
}

// Shared returns the path of rel under the shared directory, skipping the
// test when it does not exist.
func Shared(t testing.TB, rel string) string {
	t.Helper()
	p := filepath.Join(SharedDir(), rel)
	if _, err := os.Stat(p); err != nil {
		t.Skipf("shared test data %s not found (set MESHGPU_SHARED or place ../shared beside the checkout): %v", p, err)
	}
	return p
}

// GoCoder returns the gocoder-6m model directory, or skips.
// $MESHGPU_TEST_MODEL overrides it (the device check carries a copy).
func GoCoder(t testing.TB) string {
	t.Helper()
	if d := os.Getenv("MESHGPU_TEST_MODEL"); d != "" {
		return d
	}
	return Shared(t, "models/gocoder-6m")
}

// CheckGoroutines fails t if goroutines started during it are still running
// five seconds after its cleanups. Call it first in a test, so its cleanup
// runs after every server's.
func CheckGoroutines(t testing.TB) {
	t.Helper()
	before := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		for {
			// Idle keep-alive connections of the default client are not leaks.
			http.DefaultClient.CloseIdleConnections()
			n := runtime.NumGoroutine()
			if n <= before {
				return
			}
			if time.Now().After(deadline) {
				buf := make([]byte, 1<<20)
				t.Errorf("goroutine leak: %d before, %d after\n%s", before, n, buf[:runtime.Stack(buf, true)])
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
}

// NeedTool skips the test when a tool it runs (etcd, chromium) is absent,
// except under CI (CI=true), where .ci/run installs every such tool, so a
// missing one is a broken CI script and fails the test instead of hiding it.
func NeedTool(t testing.TB, path, install string) {
	t.Helper()
	if _, err := os.Stat(path); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("no %s under CI: .ci/run must install it (%s): %v", path, install, err)
		}
		t.Skipf("no %s (%s; .ci/run installs it): %v", path, install, err)
	}
}

// GoCoderGGUF returns the path of one of the gocoder-6m GGUF files
// ("bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m"), or skips.
func GoCoderGGUF(t testing.TB, variant string) string {
	t.Helper()
	return Shared(t, "models/gocoder-6m-gguf/gocoder-6m-"+variant+".gguf")
}
