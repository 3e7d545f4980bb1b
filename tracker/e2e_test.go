package tracker

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
)

// realNode is a `meshgpu run` process on 127.0.0.1.
type realNode struct {
	url string
	id  *identity.Identity
	cmd *exec.Cmd
}

func freePort(t *testing.T) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func startRealNode(t *testing.T, bin, model, layers string) *realNode {
	t.Helper()
	dir := t.TempDir()
	key := filepath.Join(dir, "node.key")
	id, err := identity.LoadOrCreate(key)
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	cmd := exec.Command(bin, "--log-level", "warn", "run", "--model", model, "--layers", layers, "--listen", addr,
		"--backend", "cpu", "--threads", "1", "--hop-dtype", "f32", "--key", key, "--hop-timeout", "5s")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	n := &realNode{url: "http://" + addr, id: id, cmd: cmd}
	t.Cleanup(func() { n.kill() })
	hc := httpClient(t)
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := hc.Get(n.url + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return n
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("node %s did not become healthy: %v", layers, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (n *realNode) kill() {
	if n.cmd.ProcessState == nil {
		n.cmd.Process.Kill()
		n.cmd.Wait()
	}
}

// TestEndToEndFailoverWithRealNodes runs real nodes (MESHGPU_BIN: a built
// meshgpu binary) over gocoder-6m: a single node's text is the reference;
// through the tracker, head 0-2 and two replicas of 3-5, the preferred
// replica is killed mid-stream and the client's text must still equal it
// (f32 hops make the split bit-identical to one node).
func TestEndToEndFailoverWithRealNodes(t *testing.T) {
	bin := os.Getenv("MESHGPU_BIN")
	if bin == "" {
		t.Skip("set MESHGPU_BIN to a meshgpu binary (go build -o /tmp/meshgpu ./cmd/meshgpu) to run real nodes")
	}
	model := testenv.GoCoder(t)
	checkGoroutines(t)
	body := `{"model":"gocoder-6m","messages":[{"role":"user","content":"Write a Go function that reverses a slice."}],` +
		`"max_tokens":160,"temperature":0,"ignore_eos":true,"stream":true}`

	single := startRealNode(t, bin, model, "0-5")
	hc := httpClient(t)
	resp, err := hc.Post(single.url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	want := readStreamFrom(t, resp.Body, true, false)
	resp.Body.Close()
	if !want.done || want.text == "" {
		t.Fatalf("single node: %+v", want)
	}
	single.kill()

	m := newProxyMesh(t, Config{TokenTimeout: 10 * time.Second})
	head := startRealNode(t, bin, model, "0-2")
	fast := startRealNode(t, bin, model, "3-5")
	spare := startRealNode(t, bin, model, "3-5")
	for _, n := range []struct {
		node        *realNode
		first, last int
		ms          float64
	}{{head, 0, 2, 1}, {fast, 3, 5, 1}, {spare, 3, 5, 3}} {
		c := &Client{URL: m.tracker.URL, Identity: n.node.id, HTTP: m.hc, Clock: m.clk.Now}
		mustRegister(t, c, reg(n.node.url, n.first, n.last, 6, n.ms))
	}

	resp = m.post(t, "/v1/chat/completions", body)
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("tracker: %d %s", resp.StatusCode, b)
	}
	// Kill the preferred replica after the fifth chunk, then read the rest.
	br := bufio.NewReader(resp.Body)
	var head5 strings.Builder
	for chunks := 0; chunks < 5; {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("stream ended after %d chunks: %v", chunks, err)
		}
		head5.WriteString(line)
		if strings.HasPrefix(line, "data: ") {
			chunks++
		}
	}
	fast.kill()
	got := readStream(t, io.MultiReader(strings.NewReader(head5.String()), br), true)
	if n := metricValue(t, m, "meshgpu_tracker_proxy_failovers_total"); n < 1 {
		t.Fatalf("no failover happened (the generation finished before the kill?): %+v", got)
	}
	if got.text != want.text || !got.done {
		t.Fatalf("through the tracker with a failover:\n%q\nsingle node:\n%q", got.text, want.text)
	}
	var nodes struct{ Nodes []NodeRecord }
	getJSON(t, m.hc, m.tracker.URL+"/nodes", &nodes)
	b, _ := json.Marshal(nodes)
	t.Logf("text equal after failover (%d bytes); nodes %s", len(got.text), b)
}

// metricValue reads an unlabelled metric from the tracker's /metrics.
func metricValue(t *testing.T, m *proxyMesh, name string) float64 {
	resp, err := m.hc.Get(m.tracker.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		var v float64
		if _, err := fmt.Sscanf(sc.Text(), name+" %g", &v); err == nil {
			return v
		}
	}
	return -1
}
