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
