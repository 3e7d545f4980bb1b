package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/model/chat"
	"meshgpu/relay"
)

// demoMesh is the demo's topology as separate processes, at default
// limits: a relay, a tracker, a head 0-1 and a middle 2-3 listening, a tail
// 4-5 reachable only through the relay.
type demoMesh struct {
	relay, tracker *proc
	relayAddr      string
	trackerURL     string
	nodes          []*autoNode
}

func startDemoMesh(t *testing.T, dir string, extra ...string) *demoMesh {
	t.Helper()
	d := &demoMesh{}
	d.relay, d.relayAddr = startProc(t, "relay", addrLine, "relay", "--listen", "127.0.0.1:0")
	var trackerAddr string
	d.tracker, trackerAddr = startProc(t, "tracker", addrLine, "tracker", "--listen", "127.0.0.1:0")
	d.trackerURL = "http://" + trackerAddr
	for i, layers := range []string{"0-1", "2-3", "4-5"} {
		key := filepath.Join(t.TempDir(), "node.key")
		id, err := identity.LoadOrCreate(key)
		if err != nil {
			t.Fatal(err)
		}
		args := append([]string{"run", "--model", dir, "--backend", "cpu", "--threads", "1", "--key", key, "--layers", layers,
			"--tracker", d.trackerURL, "--heartbeat-interval", "500ms", "--hop-dtype", "f32"}, extra...)
		n := &autoNode{id: id}
		if i == 2 {
			args = append(args, "--no-listen", "--relay", "ws://"+d.relayAddr)
			n.relayAddr = "ws://" + d.relayAddr + "/rpc/" + id.PeerID
		} else {
			args = append(args, "--listen", "127.0.0.1:0")
		}
		n.p, n.layers = startProc(t, "node "+layers, nodeLine, args...)
		if i != 2 {
			n.url = "http://" + regexp.MustCompile(`msg="listening on (\S+)"`).FindStringSubmatch(n.p.log())[1]
		}
		d.nodes = append(d.nodes, n)
	}
	hc := newHTTPClient(t)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		var m struct{ Covered bool }
		if resp, err := hc.Get(d.trackerURL + "/map?model=gocoder-6m"); err == nil {
			json.NewDecoder(resp.Body).Decode(&m)
			resp.Body.Close()
		}
		if m.Covered {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the tracker's map of gocoder-6m is not covered 30 s after the nodes started")
		}
	}
	return d
}

// sessionsLeft is the sessions every node holds, once they have drained
// (freeing a session on every hop is asynchronous to the client's [DONE]).
func (d *demoMesh) sessionsLeft(t *testing.T) map[string]int {
	t.Helper()
	hc := newHTTPClient(t)
	rc := &relay.Client{}
	defer rc.Close()
	var left map[string]int
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		left = map[string]int{}
		for _, n := range d.nodes {
			if s := sessions(t, hc, rc, n); s != 0 {
				left[n.layers] = s
			}
		}
		if len(left) == 0 || time.Now().After(deadline) {
			return left
		}
	}
}

// Issue 15's burst: 96 concurrent streamed chats (32 tokens, temperature
// 0.7, distinct seeds) through the tracker over the demo topology at
// default limits: more than the head's 64 session slots and than the
// relay's 32 requests in flight per sender. Every stream completes without
// an error event (the extra requests queue on the head, the relay's limit
// is waited out, busy is never a ban), each one's text equals the same
// request's alone on the idle mesh, and no session is left behind.
func TestBurstOf96StreamsThroughTheDemoMesh(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	d := startDemoMesh(t, dir)
	const streams = 96
	body := func(i int) []byte {
		b, _ := json.Marshal(map[string]any{"model": "gocoder-6m", "stream": true, "max_tokens": 32, "temperature": 0.7, "ignore_eos": true,
			"seed": 1000 + i, "messages": []chat.Message{{Role: "user", Content: fmt.Sprintf("Write Go function number %d.", i%7)}}})
		return b
	}
	tr := &http.Transport{MaxIdleConnsPerHost: streams, DisableCompression: true}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 5 * time.Minute}
	run := func(i int) (stream, error) {
		resp, err := hc.Post(d.trackerURL+"/v1/chat/completions", "application/json", bytes.NewReader(body(i)))
		if err != nil {
			return stream{}, err
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			msg, _ := io.ReadAll(resp.Body)
			return stream{}, fmt.Errorf("HTTP %d: %s", resp.StatusCode, msg)
		}
		return readSSE(t, resp.Body), nil
	}
	// References, one at a time (seven prompts' worth is enough: the seed
	// changes the draw, which the burst must reproduce too).
	const refs = 8
	want := make([]stream, refs)
	for i := range want {
		s, err := run(i)
		if err != nil || !s.done || s.err != "" {
			t.Fatalf("reference %d alone: %v %+v", i, err, s)
		}
		want[i] = s
	}

	start := time.Now()
	got := make([]stream, streams)
	errs := make([]error, streams)
	var wg sync.WaitGroup
	for i := 0; i < streams; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], errs[i] = run(i)
		}()
	}
	wg.Wait()
	took := time.Since(start)
	failed := 0
	var first []string
	for i := range got {
		ok := errs[i] == nil && got[i].done && got[i].err == "" && len(got[i].ids) == 32
		if ok && i < refs && got[i].text != want[i].text {
			ok = false
			errs[i] = fmt.Errorf("text %q differs from the same request alone: %q", got[i].text, want[i].text)
		}
		if !ok {
			failed++
			if len(first) < 5 {
				first = append(first, fmt.Sprintf("stream %d: err %v, done %v, error event %q, %d tokens", i, errs[i], got[i].done, got[i].err, len(got[i].ids)))
			}
		}
	}
	t.Logf("%d concurrent streams of 32 tokens in %v (%.0f tokens/s)", streams, took.Round(time.Millisecond), float64(streams*32)/took.Seconds())
	// What the burst met: the head's queue, the relay's per-sender limit.
	mc := newHTTPClient(t)
	if resp, err := mc.Get(d.nodes[0].url + "/metrics"); err == nil {
		t.Logf("head: %.1f s waited in the admission queue in all", metric(t, resp.Body, "meshgpu_node_queue_wait_seconds_sum"))
		resp.Body.Close()
	}
	if resp, err := mc.Get("http://" + d.relayAddr + "/metrics"); err == nil {
		t.Logf("relay: %v hops answered rate_limited and resent", metric(t, resp.Body, `meshgpu_relay_requests_total{path="tunnel",result="rate_limited"}`))
		resp.Body.Close()
	}
	if failed > 0 {
		t.Fatalf("%d of %d streams did not complete cleanly:\n%s\ntracker log tail:\n%s", failed, streams, strings.Join(first, "\n"), tail(d.tracker.log(), 3000))
	}
	if left := d.sessionsLeft(t); len(left) != 0 {
		t.Fatalf("sessions left behind after the burst: %v", left)
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// Issue 15's relay fault: the relay is killed (SIGKILL) mid-generation and
// started again on the same address, with the tail reachable only through
// it and no spare. The middle node's hop to the tail is resent once the
// relay is back and the tail's bridge has reconnected (a hop is a redo of
// its position), so the stream completes with the text of an undisturbed
// run, and no node keeps a session afterwards.
func TestRelayRestartMidStreamCompletesTheStream(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	d := startDemoMesh(t, dir)
	hc := newHTTPClient(t)
	body := map[string]any{"model": "gocoder-6m", "stream": true, "max_tokens": 256, "temperature": 0, "ignore_eos": true,
		"messages": []chat.Message{{Role: "user", Content: "Write a Go function that reverses a slice of strings."}}}
	want := postStream(t, hc, d.trackerURL+"/v1/chat/completions", body)
	if !want.done || want.err != "" || len(want.ids) != 256 {
		t.Fatalf("undisturbed run: %+v", want)
	}

	rest := streamAfter(t, hc, d.trackerURL+"/v1/chat/completions", body, 5)
	d.relay.kill()
	killed := time.Now()
	d.relay, _ = startProc(t, "relay again", addrLine, "relay", "--listen", d.relayAddr)
	t.Logf("relay back %v after the kill", time.Since(killed).Round(time.Millisecond))
	got := readSSE(t, rest)
	if !got.done || got.err != "" || got.text != want.text {
		t.Fatalf("stream across the relay restart (done %v, error %q, %d tokens):\n%q\nundisturbed:\n%q\nmiddle node log tail:\n%s",
			got.done, got.err, len(got.ids), got.text, want.text, tail(d.nodes[1].p.log(), 3000))
	}
	if n := strings.Count(d.nodes[2].p.log(), `msg="connected to relay"`); n < 2 {
		t.Fatalf("the tail connected to the relay %d times: the restart did not happen during the stream", n)
	}
	if left := d.sessionsLeft(t); len(left) != 0 {
		t.Fatalf("sessions left behind after the stream: %v", left)
	}
}
