package main

import (
	"strings"
	"testing"

	"meshgpu/internal/testenv"
)

// The relay, tracker and auto-shard flags refuse contradictions and bad
// values with one line naming the flag to fix.
func TestRunMeshFlagsBad(t *testing.T) {
	dir := testenv.GoCoder(t)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--model", dir, "--auto"}, "--auto needs --tracker"},
		{[]string{"--model", dir, "--auto", "--tracker", "http://127.0.0.1:1", "--layers", "0-2"}, "--layers is not allowed with --auto"},
		{[]string{"--model", dir, "--memory-budget", "1GiB"}, "--memory-budget"},
		{[]string{"--model", dir, "--auto", "--tracker", "http://127.0.0.1:1", "--memory-budget", "lots"}, "--memory-budget"},
		{[]string{"--model", dir, "--no-listen"}, "--no-listen needs --relay"},
		{[]string{"--model", dir, "--no-listen", "--relay", "ws://127.0.0.1:1", "--listen", "127.0.0.1:0"}, "--no-listen"},
		{[]string{"--model", dir, "--relay", "127.0.0.1:7000"}, "--relay"},
		{[]string{"--model", dir, "--relay", "ws://127.0.0.1:1", "--relay-mode", "carrier-pigeon"}, "--relay-mode"},
		{[]string{"--model", dir, "--tracker", "ws://127.0.0.1:1"}, "--tracker"},
		{[]string{"--model", dir, "--advertise", "http://127.0.0.1:1/path"}, "--advertise"},
		{[]string{"--model", dir, "--no-listen", "--relay", "ws://127.0.0.1:1", "--tls-cert", "c.pem", "--tls-key", "k.pem"}, "--no-listen serves no API to put TLS on"},
		{[]string{"--model", dir, "--chat-template-file", "/nonexistent.jinja"}, "--chat-template-file: chat: open /nonexistent.jinja"},
		// Issue 30: a static route with a tracker is refused, saying what to do.
		{[]string{"--model", dir, "--layers", "0-2", "--peer", "http://127.0.0.1:1", "--tracker", "http://127.0.0.1:2"}, "--peer is refused with --tracker: the tracker routes this head"},
		{[]string{"--model", dir, "--layers", "0-2", "--route", `[{"endpoint":"http://127.0.0.1:1","start_layer":3,"end_layer":5}]`, "--tracker", "http://127.0.0.1:2"}, "--route is refused with --tracker"},
	} {
		_, stderr, code := runMeshgpu(t, append([]string{"run"}, tc.args...)...)
		lines := strings.Split(strings.TrimSpace(stderr), "\n")
		last := lines[len(lines)-1]
		if code != 1 || !strings.Contains(last, tc.want) || !strings.HasPrefix(last, "meshgpu: ") {
			t.Errorf("run %v: exit %d, stderr %q; want exit 1 naming %s", tc.args, code, stderr, tc.want)
		}
	}
}

func TestParseBytes(t *testing.T) {
	for in, want := range map[string]int64{"1048576": 1 << 20, "512MiB": 512 << 20, "20GiB": 20 << 30, "1.5GB": 1_500_000_000, "800 M": 800 << 20} {
		if got, err := parseBytes(in); err != nil || got != want {
			t.Errorf("parseBytes(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "-1GiB", "0", "GiB", "12XB", "1e30TiB"} {
		if _, err := parseBytes(in); err == nil {
			t.Errorf("parseBytes(%q) accepted", in)
		}
	}
}

// A flag default written by formatBytes reads back as the same size.
func TestFormatBytesRoundTrip(t *testing.T) {
	for n, want := range map[int64]string{1 << 30: "1GiB", 512 << 20: "512MiB", 3 << 10: "3KiB", 1000: "1000", 3 << 40: "3TiB"} {
		got := formatBytes(n)
		if got != want {
			t.Errorf("formatBytes(%d) = %q, want %q", n, got, want)
		}
		if back, err := parseBytes(got); err != nil || back != n {
			t.Errorf("parseBytes(formatBytes(%d)) = %d, %v", n, back, err)
		}
	}
}
