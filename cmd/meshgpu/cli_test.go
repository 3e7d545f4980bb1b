package main

import (
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
)

// --version and `meshgpu version` print one line naming the build.
func TestVersion(t *testing.T) {
	for _, args := range [][]string{{"--version"}, {"version"}} {
		stdout, stderr, code := runMeshgpu(t, args...)
		if code != 0 || stderr != "" || !strings.HasPrefix(stdout, "meshgpu ") || strings.Count(stdout, "\n") != 1 || !strings.Contains(stdout, "go1.") {
			t.Errorf("meshgpu %v: exit %d, stdout %q, stderr %q", args, code, stdout, stderr)
		}
	}
}

// A missing required flag is one line naming it, not the whole help.
func TestMissingRequiredFlagIsOneLine(t *testing.T) {
	for _, tc := range []struct {
		args []string
		flag string
	}{
		{[]string{"run"}, "--model"},
		{[]string{"generate", "--model", "x"}, "--prompt"},
		{[]string{"model", "synth", "--shape", "tiny"}, "--out"},
	} {
		stdout, stderr, code := runMeshgpu(t, tc.args...)
		lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n")
		if code == 0 || stdout != "" || len(lines) != 1 || !strings.Contains(lines[0], tc.flag+" is required") {
			t.Errorf("meshgpu %v: exit %d, stdout %q, stderr %q; want one line saying %s is required", tc.args, code, stdout, stderr, tc.flag)
		}
	}
}

// A port in use fails at once, before the model loads (the model path here
// does not exist: loading it would fail with another message), in one line.
func TestRunPortInUseFailsBeforeLoading(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	start := time.Now()
	_, stderr, code := runMeshgpu(t, "run", "--model", filepath.Join(t.TempDir(), "missing"), "--listen", ln.Addr().String(),
		"--key", filepath.Join(t.TempDir(), "k"))
	lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n")
	if code != 1 || len(lines) != 1 || !strings.Contains(lines[0], "in use") || !strings.Contains(lines[0], "--listen") || time.Since(start) > 10*time.Second {
		t.Errorf("exit %d, stderr %q; want one line about --listen in use", code, stderr)
	}
}

// A key held by a running node is refused with the fix for the case: an
// explicit --key names --key; the default key says it is per port.
func TestRunKeyInUseSaysWhatToDo(t *testing.T) {
	dir := testenv.GoCoder(t)
	key := filepath.Join(t.TempDir(), "node.key")
	first := startRun(t, "--model", dir, "--backend", "cpu", "--threads", "1", "--listen", "127.0.0.1:0", "--key", key)
	defer first.stop(t)
	_, stderr, code := runMeshgpu(t, "run", "--model", dir, "--backend", "cpu", "--listen", "127.0.0.1:0", "--key", key)
	lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n")
	if code != 1 || len(lines) != 1 || !strings.Contains(lines[0], "in use by another meshgpu process") || !strings.Contains(lines[0], "its own --key") {
		t.Errorf("exit %d, stderr %q", code, stderr)
	}
	if msg := keyError("/home/u/.meshgpu/node-7001.key", false, errInUseForTest()); !strings.Contains(msg.Error(), "per --listen port") {
		t.Errorf("default key message %q does not explain the per-port default", msg)
	}
}

// A --peer that does not answer is reported at start.
func TestRunWarnsAboutDeadPeer(t *testing.T) {
	dir := testenv.GoCoder(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + ln.Addr().String()
	ln.Close() // nothing listens there now
	p := startRun(t, "--model", dir, "--backend", "cpu", "--threads", "1", "--listen", "127.0.0.1:0", "--layers", "0-2",
		"--key", filepath.Join(t.TempDir(), "k"), "--peer", dead)
	defer p.stop(t)
	if !strings.Contains(p.stderr.String(), "--peer does not answer") || !strings.Contains(p.stderr.String(), dead) {
		t.Errorf("no warning about %s:\n%s", dead, p.stderr)
	}
}

func errInUseForTest() error { return fmt.Errorf("%w: x", identity.ErrInUse) }

// Bad load limits are one line naming the flag, before anything loads.
func TestRunBadLoadLimitsAreOneLine(t *testing.T) {
	for _, tc := range []struct {
		args []string
		flag string
	}{
		{[]string{"--max-queue", "-1"}, "--max-queue"},
		{[]string{"--queue-wait", "0s"}, "--queue-wait"},
		{[]string{"--max-batch", "-2"}, "--max-batch"},
		{[]string{"--prefill-chunk", "0"}, "--prefill-chunk"},
	} {
		args := append([]string{"run", "--model", filepath.Join(t.TempDir(), "missing"), "--listen", "127.0.0.1:0",
			"--key", filepath.Join(t.TempDir(), "k")}, tc.args...)
		_, stderr, code := runMeshgpu(t, args...)
		lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n")
		if code == 0 || len(lines) != 1 || !strings.Contains(lines[0], tc.flag) {
			t.Errorf("meshgpu %v: exit %d, stderr %q; want one line naming %s", tc.args, code, stderr, tc.flag)
		}
	}
}
