package main

import (
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/tracker"
)

// Issue 30: --help reads well: grouped, and no line wider than 100 columns;
// every bench suite lists its own flags only.
func TestHelpIsGroupedAndFits(t *testing.T) {
	for _, args := range [][]string{{"--help"}, {"run", "--help"}, {"tracker", "--help"}, {"relay", "--help"}, {"bench", "--help"},
		{"bench", "hops", "--help"}, {"bench", "mesh", "--help"}, {"bench", "perplexity", "--help"}, {"model", "--help"}, {"demo", "--help"}} {
		out, stderr, code := runMeshgpu(t, args...)
		if code != 0 || out == "" {
			t.Fatalf("%v: exit %d, stderr %q", args, code, stderr)
		}
		for _, line := range strings.Split(out, "\n") {
			if len([]rune(line)) > helpWidth {
				t.Errorf("%v: a line of %d columns:\n%s", args, len([]rune(line)), line)
			}
		}
	}
	out, _, _ := runMeshgpu(t, "run", "--help")
	last := -1
	for _, h := range []string{"\nMODEL:\n", "\nMESH:\n", "\nLIMITS:\n", "\nSPECULATIVE DECODING:\n", "\nSECURITY:\n", "\nBACKEND (CPU, CUDA):\n", "\nLOGGING"} {
		i := strings.Index(out, h)
		if i < 0 || i < last {
			t.Fatalf("run --help: group %q missing or out of order:\n%s", strings.TrimSpace(h), out)
		}
		last = i
	}
	if strings.Contains(out, "\nOTHER:") {
		t.Errorf("run --help has flags in no group:\n%s", out[strings.Index(out, "\nOTHER:"):])
	}
	if i, j := strings.Index(out, "--cuda-graphs"), strings.Index(out, "\nBACKEND (CPU, CUDA):\n"); i < j {
		t.Errorf("a CUDA flag outside the backend group")
	}
	for suite, c := range map[string]struct{ has, hasNot []string }{
		"hops":       {[]string{"--payload-kib", "--rtt", "--tls", "--json", "--wide"}, []string{"--model", "--nodes", "--file", "--cuda-graphs"}},
		"mesh":       {[]string{"--nodes", "--speculate", "--model", "--cuda-graphs", "--plot"}, []string{"--file", "--payload-kib", "--contexts"}},
		"perplexity": {[]string{"--file", "--ctx", "--kl-base", "--json"}, []string{"--plot", "--nodes", "--rtt"}},
	} {
		out, _, _ := runMeshgpu(t, "bench", suite, "--help")
		for _, f := range c.has {
			if !strings.Contains(out, f+" ") && !strings.Contains(out, f+"\n") {
				t.Errorf("bench %s --help lacks %s", suite, f)
			}
		}
		for _, f := range c.hasNot {
			if strings.Contains(out, f+" ") {
				t.Errorf("bench %s --help lists %s, which it does not use", suite, f)
			}
		}
	}
}

// Each error of the list says what to fix, in one line.
func TestOperatorErrorsSayWhatToFix(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"run", "--model", "x", "--tracker", "127.0.0.1:7100"}, "--tracker \"127.0.0.1:7100\" has no scheme: write --tracker http://127.0.0.1:7100"},
		{[]string{"run", "--model", "x", "--relay", "relay.example.org:7000"}, "write --relay ws://relay.example.org:7000"},
		{[]string{"tracker", "--listen", busy.Addr().String()}, "the address is in use (another meshgpu process?); stop it or pick a free port, e.g. --listen 127.0.0.1:7101"},
		{[]string{"relay", "--listen", busy.Addr().String()}, "the address is in use (another meshgpu process?); stop it or pick a free port, e.g. --listen 0.0.0.0:7010"},
		{[]string{"tracker", "--tls-cert", "c.pem"}, "--tls-cert and --tls-key go together"},
		{[]string{"tracker", "--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"}, "want PEM files"},
	} {
		_, stderr, code := runMeshgpu(t, tc.args...)
		lines := strings.Split(strings.TrimSpace(stderr), "\n")
		if code != 1 || len(lines) != 1 || !strings.Contains(lines[0], tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want one line with %q", tc.args, code, stderr, tc.want)
		}
	}
}

// --auto with a budget that holds no layer: the tracker's refusal says
// how much one layer needs and which flags change that.
func TestMemoryBudgetTooSmallSaysHowMuch(t *testing.T) {
	dir := testenv.GoCoder(t)
	tr := tracker.NewServer(tracker.Config{Endpoints: tracker.AddrPolicy{AllowLoopback: true}, SkipEndpointCheck: true})
	ts := httptest.NewServer(tr.Handler())
	defer ts.Close()
	_, stderr, code := runMeshgpu(t, "run", "--model", dir, "--backend", "cpu", "--threads", "1", "--key", filepath.Join(t.TempDir(), "k"),
		"--listen", "127.0.0.1:0", "--auto", "--tracker", ts.URL, "--memory-budget", "1MiB")
	lines := strings.Split(strings.TrimSpace(stderr), "\n")
	last := lines[len(lines)-1]
	if code != 1 || !strings.Contains(last, "the budget is 1.0 MiB and one layer needs") || !strings.Contains(last, "give the node --memory-budget") ||
		!strings.Contains(last, "MiB or more, or lower its --max-sessions or --max-context") {
		t.Fatalf("exit %d, last line %q; want the size one layer needs and the flags to change", code, last)
	}
}

// A node listening on all interfaces without --advertise names the flag.
func TestAllInterfacesWarnsToAdvertise(t *testing.T) {
	dir := testenv.GoCoder(t)
	tr := tracker.NewServer(tracker.Config{Endpoints: tracker.AddrPolicy{AllowLoopback: true, AllowPrivate: true}, SkipEndpointCheck: true})
	ts := httptest.NewServer(tr.Handler())
	defer ts.Close()
	p := startRun(t, "--model", dir, "--backend", "cpu", "--threads", "1", "--key", filepath.Join(t.TempDir(), "k"),
		"--listen", "0.0.0.0:0", "--tracker", ts.URL)
	if !strings.Contains(p.stderr.String(), "pass --advertise http://ADDRESS:PORT with an address they can reach") {
		t.Fatalf("no warning naming --advertise:\n%s", p.stderr)
	}
}

// `make build` stamps --version with git describe.
func TestMakefileStampsTheVersion(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("skipping: no make")
	}
	root := testenv.RepoRoot()
	want, err := exec.Command("git", "-C", root, "describe", "--tags", "--always", "--dirty").Output()
	if err != nil {
		t.Skipf("skipping: not a git checkout (%v)", err)
	}
	bin := filepath.Join(t.TempDir(), "meshgpu")
	mk := exec.Command("make", "-C", root, "build", "BIN="+bin)
	if out, err := mk.CombinedOutput(); err != nil {
		t.Fatalf("make build: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "--version").Output()
	if err != nil {
		t.Fatal(err)
	}
	if v := strings.TrimSpace(string(want)); !strings.Contains(string(out), "meshgpu "+v) {
		t.Fatalf("--version printed %q; want it stamped with git describe %q", out, v)
	}
	_ = os.Remove(bin)
}

// An empty tracker says no node serves the model yet, not that it does not
// exist.
func TestEmptyTrackerSaysNoNodeYet(t *testing.T) {
	tr := tracker.NewServer(tracker.Config{})
	ts := httptest.NewServer(tr.Handler())
	defer ts.Close()
	hc := &http.Client{Timeout: 5 * time.Second}
	resp, err := hc.Post(ts.URL+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"gocoder-6m","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b := new(strings.Builder)
	_, _ = new(strings.Builder), resp.Body
	buf := make([]byte, 4096)
	n, _ := resp.Body.Read(buf)
	b.Write(buf[:n])
	if resp.StatusCode != 404 || !strings.Contains(b.String(), `no node serves \"gocoder-6m\" yet`) {
		t.Fatalf("chat to an empty tracker: %d %s", resp.StatusCode, b)
	}
}
