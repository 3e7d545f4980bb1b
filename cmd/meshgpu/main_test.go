package main

import (
	"strings"
	"testing"
)

// A bad flag anywhere in the command tree is one error line on stderr that
// names the command's help, with nothing on stdout.
func TestBadFlagIsOneLine(t *testing.T) {
	for _, args := range [][]string{
		{"--bogus"},
		{"run", "--bogus"},
		{"relay", "--bogus"},
		{"tracker", "--bogus"},
		{"model", "synth", "--bogus"},
		{"bench", "hops", "--bogus"},
	} {
		stdout, stderr, code := runMeshgpu(t, args...)
		want := "meshgpu " + strings.Join(args[:len(args)-1], " ")
		want = strings.TrimSpace(want) + " --help"
		lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n")
		if code == 0 || stdout != "" || len(lines) != 1 || !strings.Contains(lines[0], "-bogus") || !strings.Contains(lines[0], want) {
			t.Errorf("meshgpu %v: exit %d, stdout %q, stderr %q; want exit != 0, no stdout, one line naming -bogus and %q",
				args, code, stdout, stderr, want)
		}
	}
}

// A bad --store, or an etcd that does not answer, is one line naming the
// flag, and a non-zero exit.
func TestTrackerBadStoreIsOneLine(t *testing.T) {
	for _, store := range []string{"redis://x:1", "etcd://", "etcd://127.0.0.1"} {
		stdout, stderr, code := runMeshgpu(t, "tracker", "--listen", "127.0.0.1:0", "--store", store)
		lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n")
		if code == 0 || stdout != "" || !strings.Contains(lines[len(lines)-1], "--store") {
			t.Errorf("--store %s: exit %d, stdout %q, stderr %q; want a line naming --store", store, code, stdout, stderr)
		}
	}
}
