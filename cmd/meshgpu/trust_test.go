package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Misconfigured API keys, origins and relay tokens exit non-zero with one
// line naming the flag.
func TestTrustFlagsAreChecked(t *testing.T) {
	empty := filepath.Join(t.TempDir(), "keys")
	os.WriteFile(empty, []byte("# no key here\n"), 0o600)
	for _, tc := range []struct {
		args []string
		flag string
	}{
		{[]string{"tracker", "--listen", "127.0.0.1:0", "--relay-join-token", "s"}, "--relay"},
		{[]string{"tracker", "--listen", "127.0.0.1:0", "--api-key-file", empty}, "--api-key"},
		{[]string{"tracker", "--listen", "127.0.0.1:0", "--api-key", "has space"}, "--api-key"},
		{[]string{"tracker", "--listen", "127.0.0.1:0", "--allowed-origins", "localhost:3000"}, "--allowed-origins"},
		{[]string{"run", "--model", "x", "--api-key-file", filepath.Join(t.TempDir(), "missing")}, "--api-key"},
	} {
		stdout, stderr, code := runMeshgpu(t, tc.args...)
		lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n")
		if code == 0 || stdout != "" || !strings.Contains(lines[len(lines)-1], tc.flag) {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want a line naming %s", tc.args, code, stdout, stderr, tc.flag)
		}
	}
}
