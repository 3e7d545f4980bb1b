package e2e

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/model/chat"
	"meshgpu/tracker"
)

// Issue 30: what an operator sees when things stop. These run the demo
// topology as processes (relay, tracker, head 0-1, mid 2-3, relay-only tail
// 4-5) and break it.

// signal sends sig to the process.
func (p *proc) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal %v to %s: %v", sig, p.name, err)
	}
}

// waitExit waits up to d for the process to exit and returns its status.
func (p *proc) waitExit(t *testing.T, d time.Duration) int {
	t.Helper()
	select {
	case <-p.exited:
		return p.cmd.ProcessState.ExitCode()
	case <-time.After(d):
		t.Fatalf("%s still running %v after the signal:\n%s", p.name, d, tail(p.log(), 3000))
	}
	return -1
}

// chatOnce posts a short non-streaming chat and returns the status and body.
func chatOnce(hc *http.Client, url string) (int, string) {
	b, _ := json.Marshal(map[string]any{"model": "gocoder-6m", "max_tokens": 8, "temperature": 0,
		"messages": []chat.Message{{Role: "user", Content: "Write Go."}}})
	resp, err := hc.Post(url+"/v1/chat/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

func trackerNodes(t *testing.T, hc *http.Client, trackerURL string) []tracker.PublicNode {
	t.Helper()
	var out struct{ Nodes []tracker.PublicNode }
	resp, err := hc.Get(trackerURL + "/nodes")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return out.Nodes
}

func hasNode(nodes []tracker.PublicNode, peerID string) bool {
	for _, n := range nodes {
		if n.PeerID == peerID {
			return true
		}
	}
	return false
}

// getStatus is GET url's status and body.
func getStatus(hc *http.Client, url string) (int, string) {
	resp, err := hc.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// The relay dies under the relay-only tail: the tail's next heartbeat
// (sent at once) says so, the tracker stops routing through it, and a chat
// fails within 5 s with an error naming the relay; nothing is banned. The
// relay back, the tail reconnects and announces it, and chats succeed
// within 3 s of the reconnect. The head's /ready follows: 503 during the
// outage (nothing routes through it), 200 again after.
func TestRelayOutageFailsFastAndRecovers(t *testing.T) {
	dir := testenv.GoCoder(t)
	d := startDemoMesh(t, dir)
	hc := newHTTPClient(t)
	head := d.nodes[0].url
	if st, body := waitStatus(hc, head+"/ready", 200, 5*time.Second); st != 200 {
		t.Fatalf("tracker-joined head /ready: %d %s; want 200 once registered and routable", st, body)
	}
	if st, body := chatOnce(hc, d.trackerURL); st != 200 {
		t.Fatalf("chat before the outage: %d %s", st, body)
	}
	// Sent to the head itself, a chat is pointed at the tracker.
	if st, body := chatOnce(hc, head); st != 503 || !strings.Contains(body, "send chats to the tracker, "+d.trackerURL+"/v1/chat/completions") {
		t.Fatalf("chat straight to a tracker-joined head: %d %s; want 503 naming the tracker", st, body)
	}

	d.relay.kill()
	killed := time.Now()
	st, body := chatOnce(hc, d.trackerURL)
	failedIn := time.Since(killed)
	t.Logf("relay killed: first chat answered %d in %v: %s", st, failedIn.Round(time.Millisecond), body)
	if st == 200 || failedIn > 5*time.Second || !strings.Contains(body, "relay") || !strings.Contains(body, d.relayAddr) {
		t.Fatalf("chat with the relay down: %d after %v: %s\nwant an error within 5 s naming the relay %s\ntracker log:\n%s\nhead log:\n%s\nmiddle log:\n%s\ntail log:\n%s", st, failedIn, body, d.relayAddr, tail(d.tracker.log(), 4000), tail(d.nodes[0].p.log(), 3000), tail(d.nodes[1].p.log(), 3000), tail(d.nodes[2].p.log(), 3000))
	}
	start := time.Now()
	st, body = chatOnce(hc, d.trackerURL)
	t.Logf("second chat during the outage: %d in %v", st, time.Since(start).Round(time.Millisecond))
	if st != 503 || !strings.Contains(body, "relay_unavailable") || time.Since(start) > time.Second {
		t.Fatalf("second chat during the outage: %d after %v: %s; want 503 relay_unavailable at once", st, time.Since(start), body)
	}
	for _, n := range trackerNodes(t, hc, d.trackerURL) {
		if n.RelayDown != (n.PeerID == d.nodes[2].id.PeerID) {
			t.Fatalf("/nodes during the outage: %s relay_down %v", n.PeerID, n.RelayDown)
		}
	}
	if st, body := waitStatus(hc, head+"/ready", 503, 3*time.Second); st != 503 || !strings.Contains(body, "4-5") {
		t.Fatalf("head /ready during the outage: %d %s; want 503 naming layers 4-5", st, body)
	}

	d.relay, _ = startProc(t, "relay again", addrLine, "relay", "--listen", d.relayAddr)
	back := time.Now()
	var reconnected time.Time
	for deadline := time.Now().Add(15 * time.Second); reconnected.IsZero(); time.Sleep(20 * time.Millisecond) {
		if strings.Count(d.nodes[2].p.log(), `msg="connected to relay"`) >= 2 {
			reconnected = time.Now()
		} else if time.Now().After(deadline) {
			t.Fatalf("the tail did not reconnect within 15 s of the relay's restart:\n%s", tail(d.nodes[2].p.log(), 3000))
		}
	}
	for {
		st, body = chatOnce(hc, d.trackerURL)
		if st == 200 {
			break
		}
		if time.Since(reconnected) > 3*time.Second {
			t.Fatalf("chat %v after the tail reconnected: %d %s\ntracker log:\n%s", time.Since(reconnected), st, body, tail(d.tracker.log(), 3000))
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("relay back: the tail reconnected after %v, chats succeed %v after that",
		reconnected.Sub(back).Round(time.Millisecond), time.Since(reconnected).Round(time.Millisecond))
	if strings.Contains(d.tracker.log(), "banning node") {
		t.Fatalf("the tracker banned a node for the relay's outage:\n%s", tail(d.tracker.log(), 3000))
	}
	if st, body := waitStatus(hc, head+"/ready", 200, 3*time.Second); st != 200 {
		t.Fatalf("head /ready after the outage: %d %s", st, body)
	}
}

// waitStatus polls url until it answers want or d passes; it returns the
// last answer.
func waitStatus(hc *http.Client, url string, want int, d time.Duration) (int, string) {
	deadline := time.Now().Add(d)
	for {
		st, body := getStatus(hc, url)
		if st == want || time.Now().After(deadline) {
			return st, body
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// SIGTERM drains a node: one serving no session is gone from /nodes within
// 2 s and exits 0; the only middle node, stopped during a stream, leaves
// the tracker at once, serves the stream to its end (the text equals an
// undisturbed run) and then exits 0.
func TestSIGTERMDrainsTheNode(t *testing.T) {
	dir := testenv.GoCoder(t)
	d := startDemoMesh(t, dir)
	hc := newHTTPClient(t)

	// A spare of the middle range that never serves: gone within 2 s.
	key := filepath.Join(t.TempDir(), "spare.key")
	id, err := identity.LoadOrCreate(key)
	if err != nil {
		t.Fatal(err)
	}
	spare, _ := startProc(t, "spare 2-3", nodeLine, "run", "--model", dir, "--backend", "cpu", "--threads", "1", "--key", key,
		"--layers", "2-3", "--tracker", d.trackerURL, "--heartbeat-interval", "500ms", "--listen", "127.0.0.1:0")
	for deadline := time.Now().Add(10 * time.Second); !hasNode(trackerNodes(t, hc, d.trackerURL), id.PeerID); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the spare never registered")
		}
	}
	spare.signal(t, syscall.SIGTERM)
	sent := time.Now()
	for hasNode(trackerNodes(t, hc, d.trackerURL), id.PeerID) {
		if time.Since(sent) > 2*time.Second {
			t.Fatalf("the idle node is still in /nodes %v after SIGTERM:\n%s", time.Since(sent), tail(spare.log(), 2000))
		}
		time.Sleep(20 * time.Millisecond)
	}
	gone := time.Since(sent)
	if code := spare.waitExit(t, 10*time.Second); code != 0 {
		t.Fatalf("the idle node exited %d after SIGTERM:\n%s", code, tail(spare.log(), 2000))
	}
	t.Logf("idle node: gone from /nodes %v after SIGTERM, exited after %v", gone.Round(time.Millisecond), time.Since(sent).Round(time.Millisecond))

	// The middle node, mid-stream.
	body := map[string]any{"model": "gocoder-6m", "stream": true, "max_tokens": 200, "temperature": 0, "ignore_eos": true,
		"messages": []chat.Message{{Role: "user", Content: "Write a Go function that sums a slice."}}}
	want := postStream(t, hc, d.trackerURL+"/v1/chat/completions", body)
	if !want.done || want.err != "" {
		t.Fatalf("undisturbed run: %+v", want)
	}
	mid := d.nodes[1]
	rest := streamAfter(t, hc, d.trackerURL+"/v1/chat/completions", body, 5)
	mid.p.signal(t, syscall.SIGTERM)
	sent = time.Now()
	got := readSSE(t, rest)
	if !got.done || got.err != "" || got.text != want.text {
		t.Fatalf("stream across the middle node's SIGTERM (done %v, error %q):\n%q\nundisturbed:\n%q\nmid log:\n%s",
			got.done, got.err, got.text, want.text, tail(mid.p.log(), 3000))
	}
	if hasNode(trackerNodes(t, hc, d.trackerURL), mid.id.PeerID) {
		t.Fatal("the draining node is still in /nodes after its stream")
	}
	if code := mid.p.waitExit(t, 10*time.Second); code != 0 {
		t.Fatalf("the drained node exited %d:\n%s", code, tail(mid.p.log(), 2000))
	}
	if !strings.Contains(mid.p.log(), "drained") {
		t.Fatalf("the middle node did not drain:\n%s", tail(mid.p.log(), 3000))
	}
	t.Logf("middle node: stream completed and the node exited %v after SIGTERM", time.Since(sent).Round(time.Millisecond))
	if strings.Contains(d.tracker.log(), "banning node") {
		t.Fatalf("the tracker banned a node during a drain:\n%s", tail(d.tracker.log(), 3000))
	}
}
