package main

import (
	"strings"
	"testing"
)

// Impossible audit settings exit non-zero with one line naming the flags.
func TestAuditFlagsAreChecked(t *testing.T) {
	for _, args := range [][]string{
		{"tracker", "--listen", "127.0.0.1:0", "--audit-rate", "1.5"},
		{"tracker", "--listen", "127.0.0.1:0", "--audit-rate", "-0.1"},
		{"tracker", "--listen", "127.0.0.1:0", "--audit-tolerance", "0"},
		{"tracker", "--listen", "127.0.0.1:0", "--audit-ban", "0s"},
	} {
		stdout, stderr, code := runMeshgpu(t, args...)
		lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n")
		if code == 0 || stdout != "" || !strings.Contains(lines[len(lines)-1], "--audit-") {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want one line naming the --audit- flags", args, code, stdout, stderr)
		}
	}
}
