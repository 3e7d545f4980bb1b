// Package testenv finds the shared test data (../shared beside the checkout)
// and skips tests with a clear message when it is absent.
package testenv

import (
	"os"
	"path/filepath"
	"runtime"
	"testing"
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
