package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"path/filepath"
	"regexp"
	"slices"
	"syscall"
	"testing"
	"time"

	"meshgpu/daemon"
	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/model"
	"meshgpu/model/chat"
	"meshgpu/relay"
	"meshgpu/tracker"
)

var (
	addrLine = regexp.MustCompile(`msg="(?:relay|tracker) listening".* addr=(\S+)`)
	nodeLine = regexp.MustCompile(`msg="(?:listening on \S+|serving through the relay only)".* layers=(\d+-\d+)`)
)

// autoNode is a `meshgpu run --auto` process.
type autoNode struct {
	p         *proc
	id        *identity.Identity
	url       string // "" for the --no-listen node
	relayAddr string
	layers    string
}

// Issue 7, end to end with separate processes: a tracker, a relay and four
// `meshgpu run --auto` nodes (the second with --no-listen, reachable only
// through the relay) over gocoder-6m. Memory budgets, computed from the
// model's byte counts, fit three layers (plus embeddings or head) but not
// four, so the tracker splits the model 0-2 / 3-5 and the last two nodes
// become spares (which range each takes depends on the compute speeds the
// nodes measure). A chat completion through the tracker equals
// engine.Generate on one in-process model over the same rendered prompt;
// heartbeats carry the rolling stats of that work; then a node serving a
// second stream whose range has a spare (the direct tail when 3-5 has two
// replicas) is killed (SIGKILL) after five chunks, and the stream still
// completes with the same text (f32 hops: the split is bit-identical), with
// a failover counted by the tracker. The second stream decodes with ngram
// drafts and up to four passes in flight (greedy: the same text), so the
// kill comes with passes in flight; afterwards no node holds a session.
func TestTrackerAutoShardAndFailover(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	const maxTokens = 200
	msgs := []chat.Message{{Role: "user", Content: "Write a Go function that reverses a slice of strings."}}

	// Reference: one model holding every layer, in this process.
	ref := wholeModelChat(t, dir, msgs, maxTokens)

	// Budgets: three layers with the embeddings (head) or the LM head
	// (tail) fit; four middle layers do not.
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	const maxCtx, maxSessions = 512, 4
	fp := daemon.FootprintOf(cfg, "cpu", maxCtx, maxSessions)
	layer := fp.BytesPerLayer + fp.KVReservePerLayer
	budget := 3*layer + max(fp.EmbedBytes, fp.HeadBytes)
	if 4*layer <= budget {
		t.Fatalf("budget %d would fit four layers of %d bytes: pick a larger KV reserve", budget, layer)
	}

	_, relayAddr := startProc(t, "relay", addrLine, "relay", "--listen", "127.0.0.1:0")
	_, trackerAddr := startProc(t, "tracker", addrLine, "tracker", "--listen", "127.0.0.1:0", "--token-timeout", "5s", "--audit-rate", "0", "--audit-probation=false")
	trackerURL := "http://" + trackerAddr
	relayURL := "ws://" + relayAddr

	// The second node to join always gets 3-5 (the uncovered half), so the
	// relay-only node is a tail: the tracker prefers the direct tail (lower
	// network cost), and when that one is killed the stream fails over to
	// the tail reachable only through the relay.
	const relayOnly = 1
	var nodes []*autoNode
	for i := 0; i < 4; i++ {
		key := filepath.Join(t.TempDir(), "node.key")
		id, err := identity.LoadOrCreate(key)
		if err != nil {
			t.Fatal(err)
		}
		args := []string{"run", "--model", dir, "--backend", "cpu", "--threads", "1", "--key", key,
			"--auto", "--memory-budget", fmt.Sprint(budget), "--tracker", trackerURL,
			"--hop-dtype", "f32", "--hop-timeout", "5s", "--max-sessions", fmt.Sprint(maxSessions),
			"--max-context", fmt.Sprint(maxCtx), "--heartbeat-interval", "500ms"}
		n := &autoNode{id: id}
		if i == relayOnly {
			args = append(args, "--no-listen", "--relay", relayURL)
			n.relayAddr = relayURL + "/rpc/" + id.PeerID
		} else {
			args = append(args, "--listen", "127.0.0.1:0")
		}
		n.p, n.layers = startProc(t, fmt.Sprintf("node %d", i), nodeLine, args...)
		if i != relayOnly {
			n.url = "http://" + regexp.MustCompile(`msg="listening on (\S+)"`).FindStringSubmatch(n.p.log())[1]
		}
		nodes = append(nodes, n)
	}
	var ranges []string
	for _, n := range nodes {
		ranges = append(ranges, n.layers)
	}
	count := map[string]int{}
	for _, r := range ranges {
		count[r]++
	}
	// The first joiner takes 0-2 and the second the uncovered 3-5; the
	// spares go where throughput is lowest (ADR-0013), so usually one each.
	if ranges[0] != "0-2" || ranges[relayOnly] != "3-5" || count["0-2"]+count["3-5"] != 4 {
		t.Fatalf("the tracker assigned %v in join order; want 0-2, 3-5, then spares of those ranges", ranges)
	}

	hc := newHTTPClient(t)
	body := map[string]any{"model": "gocoder-6m", "messages": msgs, "max_tokens": maxTokens,
		"temperature": 0, "ignore_eos": true, "stream": true}
	first := postStream(t, hc, trackerURL+"/v1/chat/completions", body)
	if !first.done || first.err != "" || first.text != ref.Text {
		t.Fatalf("through the tracker (done %v, error %q):\n%q\none in-process model:\n%q", first.done, first.err, first.text, ref.Text)
	}
	if !slices.Equal(first.ids, ref.IDs) {
		t.Fatalf("through the tracker the ids differ from one in-process model (f32 hops must be bit-identical):\n%v\n%v", first.ids, ref.IDs)
	}

	// Heartbeats carry the rolling stats: the head drove maxTokens steps and
	// the tail served maxTokens hops (the prompt, then one per token but the
	// last), all within the last minute.
	var rpm1, rpm5, tps float64
	deadline := time.Now().Add(10 * time.Second)
	for rpm1 != 2*maxTokens && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
		var v struct{ Nodes []tracker.NodeRecord }
		getJSON(t, hc, trackerURL+"/nodes", &v)
		rpm1, rpm5, tps = 0, 0, 0
		for _, r := range v.Nodes {
			rpm1 += r.Stats.RPM1
			rpm5 += r.Stats.RPM5
			tps += r.Stats.TokensPerSec
		}
	}
	// Tokens: the head counts those it drove, the tail those it sampled.
	if rpm1 != 2*maxTokens || rpm5 != 2*maxTokens/5.0 || math.Abs(tps-2*maxTokens/60.0) > 1e-9 {
		t.Errorf("heartbeats report rpm1 %v, rpm5 %v, tokens/s %v summed over the nodes; want %v, %v, %v\nnode 0 log:\n%s",
			rpm1, rpm5, tps, 2*maxTokens, 2*maxTokens/5.0, 2*maxTokens/60.0, nodes[0].p.log())
	}

	// Second stream: kill a node that serves it after five chunks.
	spec := maps.Clone(body)
	spec["meshgpu"] = map[string]any{"speculate": "ngram"}
	rest := streamAfter(t, hc, trackerURL+"/v1/chat/completions", spec, 5)
	rc := &relay.Client{}
	defer rc.Close()
	// The victim serves the stream and has a spare; a direct tail first.
	var victim *autoNode
	for _, n := range nodes {
		if count[n.layers] < 2 || sessions(t, hc, rc, n) == 0 {
			continue
		}
		if victim == nil || (n.layers == "3-5" && n.url != "") {
			victim = n
		}
	}
	if victim == nil {
		t.Fatalf("no node with a spare holds the stream's session (ranges %v)", ranges)
	}
	victim.p.kill()
	got := readSSE(t, rest)
	if !got.done || got.err != "" || got.text != ref.Text {
		t.Errorf("after killing the node holding %s (relay-only %v) mid-stream (done %v, error %q):\n%q\nuninterrupted:\n%q",
			victim.layers, victim.url == "", got.done, got.err, got.text, ref.Text)
	}
	if !slices.Equal(got.ids, ref.IDs) {
		t.Errorf("after the failover the ids differ from the uninterrupted run (f32 hops):\n%v\n%v", got.ids, ref.IDs)
	}
	// No session is left behind: the failed route's sessions are freed
	// (the head's passes in flight with them), the replay's at its end.
	for _, n := range nodes {
		if n == victim {
			continue
		}
		deadline := time.Now().Add(10 * time.Second)
		for sessions(t, hc, rc, n) != 0 && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
		}
		if k := sessions(t, hc, rc, n); k != 0 {
			t.Errorf("node %s (layers %s) still holds %d sessions after the failover", n.id.PeerID, n.layers, k)
		}
	}
	// The heads drafted (the second stream was speculative) and kept passes
	// in flight (some were dropped after rejected drafts).
	var drafted, dropped float64
	for _, n := range nodes {
		if n == victim || n.url == "" {
			continue
		}
		mresp, err := hc.Get(n.url + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(mresp.Body)
		mresp.Body.Close()
		drafted += metric(t, bytes.NewReader(b), `meshgpu_node_speculative_draft_tokens_total{mode="ngram"}`)
		dropped += metric(t, bytes.NewReader(b), "meshgpu_node_speculative_dropped_passes_total")
	}
	if drafted == 0 {
		t.Errorf("no head drafted: the second stream decoded plainly")
	}
	t.Logf("the speculative stream: %v tokens drafted, %v passes in flight dropped", drafted, dropped)
	mresp, err := hc.Get(trackerURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	failovers := metric(t, mresp.Body, "meshgpu_tracker_proxy_failovers_total")
	mresp.Body.Close()
	if failovers < 1 {
		t.Errorf("the tracker counted %v failovers; the kill came after the stream ended?", failovers)
	}
	relayed := relayRequests(t, hc, "http://"+relayAddr, "tunnel") + relayRequests(t, hc, "http://"+relayAddr, "rpc")
	// Either the killed direct tail's spare is the relay-only node, or that
	// node is the only tail: hops reached it through the relay.
	if relayed == 0 {
		t.Errorf("no hop reached the --no-listen tail through the relay")
	}
	t.Logf("split %v; killed the node holding %s (relay-only %v) mid-stream; %v failover(s); %v hops relayed to the --no-listen tail; %d bytes of text equal",
		ranges, victim.layers, victim.url == "", failovers, relayed, len(got.text))
}

// sessions reads a node's /health sessions, directly or through the relay.
func sessions(t *testing.T, hc *http.Client, rc *relay.Client, n *autoNode) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var resp *http.Response
	var err error
	if n.url != "" {
		req, _ := http.NewRequestWithContext(ctx, "GET", n.url+"/health", nil)
		resp, err = hc.Do(req)
	} else {
		req, _ := http.NewRequestWithContext(ctx, "GET", "http://relay/health", nil)
		resp, err = rc.Do(ctx, n.relayAddr, req)
	}
	if err != nil {
		t.Fatalf("health of %s: %v", n.id.PeerID, err)
	}
	defer resp.Body.Close()
	var h struct{ Sessions int }
	if err := json.NewDecoder(resp.Body).Decode(&h); err != nil {
		t.Fatalf("health of %s: %v", n.id.PeerID, err)
	}
	return h.Sessions
}

func getJSON(t *testing.T, hc *http.Client, url string, v any) {
	t.Helper()
	resp, err := hc.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
}

// A relay-only node registered with the tracker (no endpoint, its relay
// address instead) answers through the relay, and SIGTERM stops it cleanly
// (exit 0) with its bridge and announcer.
func TestRelayOnlyNodeRegistersAndStops(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	_, relayAddr := startProc(t, "relay", addrLine, "relay", "--listen", "127.0.0.1:0")
	_, trackerAddr := startProc(t, "tracker", addrLine, "tracker", "--listen", "127.0.0.1:0", "--audit-rate", "0", "--audit-probation=false")
	key := filepath.Join(t.TempDir(), "node.key")
	id, err := identity.LoadOrCreate(key)
	if err != nil {
		t.Fatal(err)
	}
	p, layers := startProc(t, "node", nodeLine, "run", "--model", dir, "--backend", "cpu", "--threads", "1", "--key", key,
		"--no-listen", "--relay", "ws://"+relayAddr, "--relay-mode", "rpc", "--tracker", "http://"+trackerAddr, "--heartbeat-interval", "200ms")
	if layers != "0-5" {
		t.Fatalf("layers %s", layers)
	}
	hc := newHTTPClient(t)
	var v struct{ Nodes []tracker.NodeRecord }
	getJSON(t, hc, "http://"+trackerAddr+"/nodes", &v)
	wantAddr := "ws://" + relayAddr + "/rpc/" + id.PeerID
	if len(v.Nodes) != 1 || v.Nodes[0].PeerID != id.PeerID || v.Nodes[0].Endpoint != "" || v.Nodes[0].RelayAddr != wantAddr ||
		v.Nodes[0].Layers != [2]int{0, 5} || v.Nodes[0].MsPerLayer <= 0 || v.Nodes[0].Verified != tracker.VerifiedRelay {
		t.Fatalf("tracker nodes %+v; want %s relay-only at %s", v.Nodes, id.PeerID, wantAddr)
	}
	rc := &relay.Client{DisableTunnel: true}
	defer rc.Close()
	n := &autoNode{id: id, relayAddr: wantAddr}
	if s := sessions(t, hc, rc, n); s != 0 {
		t.Fatalf("sessions %d", s)
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
		if code := p.cmd.ProcessState.ExitCode(); code != 0 {
			t.Errorf("exit %d after SIGTERM:\n%s", code, p.log())
		}
	case <-time.After(15 * time.Second):
		t.Fatalf("no exit 15s after SIGTERM:\n%s", p.log())
	}
}
