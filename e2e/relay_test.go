package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"meshgpu/daemon"
	"meshgpu/internal/metricstest"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/wire"
)

type goldenGeneration struct {
	Prompt    string  `json:"prompt"`
	PromptIDs []int32 `json:"prompt_ids"`
	FP32      struct {
		GreedyIDs []int32 `json:"greedy_ids"`
	} `json:"fp32"`
}

func loadGolden(t *testing.T, dir string) []goldenGeneration {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	var g struct {
		Generations []goldenGeneration `json:"generations"`
	}
	if err := json.Unmarshal(b, &g); err != nil || len(g.Generations) == 0 {
		t.Fatalf("golden.json generations: %v", err)
	}
	return g.Generations
}

func openCPU(t *testing.T) native.Backend {
	t.Helper()
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	return be
}

// threeNodes starts head 0-1, mid 2-3 and tail 4-5 in this process. With
// relayURL the tail listens nowhere and is reached only through the relay
// (the mid node sends it hops with relay mode mode); otherwise every node is
// direct; directReplies has the head name its endpoint in its tickets
// (--direct-replies). It returns the head's URL and the tail.
func threeNodes(t *testing.T, dir string, be native.Backend, relayURL, mode string, directReplies ...bool) (string, *daemon.Node) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	common := daemon.Config{ModelDir: dir, Backend: be, MaxSessions: 4, MaxContext: 256,
		HopTimeout: 10 * time.Second, Logger: quietLogger(), RelayMode: mode}
	// A static mesh: mid and tail take the head's route tickets (--trust-head).
	headID := newIdentity(t)
	start := func(first, last int, route []wire.Hop, edit func(*daemon.Config)) *daemon.Node {
		c := common
		c.Identity, c.First, c.Last, c.Route = newIdentity(t), first, last, route
		if first == 0 {
			c.Identity = headID
		} else {
			c.TrustHeads = []string{headID.PeerID}
		}
		if edit != nil {
			edit(&c)
		}
		n, err := daemon.Start(ctx, c)
		if err != nil {
			t.Fatalf("node %d-%d: %v", first, last, err)
		}
		t.Cleanup(func() { n.Close() })
		return n
	}
	var tail *daemon.Node
	if relayURL != "" {
		tail = start(4, 5, nil, func(c *daemon.Config) { c.NoListen, c.RelayURL = true, relayURL })
	} else {
		tail = start(4, 5, nil, nil)
	}
	mid := start(2, 3, nil, nil)
	route := []wire.Hop{
		{Endpoint: mid.URL(), StartLayer: 2, EndLayer: 3, PeerID: mid.PeerID()},
		{Endpoint: tail.URL(), StartLayer: 4, EndLayer: 5, PeerID: tail.PeerID(), RelayAddr: tail.RelayAddr()},
	}
	head := start(0, 1, route, func(c *daemon.Config) { c.DirectReplies = len(directReplies) > 0 && directReplies[0] })
	return head.URL(), tail
}

// Issue 6: a three-node mesh over gocoder-6m whose tail runs with no
// listener behind the relay answers the golden prompts (64 greedy tokens,
// /v1/completions) with the same text and ids as the same mesh over direct
// HTTP, over ADR-0014's /rpc (the tail's bridge on /ws) and over the tunnel.
// The relay's metrics prove which path carried the hops; the direct mesh's
// first 16 ids are checked against HF transformers' golden ids.
func TestRelayOnlyTailMatchesDirectMesh(t *testing.T) {
	dir := testenv.GoCoder(t)
	golden := loadGolden(t, dir)
	testenv.CheckGoroutines(t)
	be := openCPU(t)
	hc := newHTTPClient(t)
	generate := func(head string) []stream {
		var out []stream
		for i, g := range golden {
			s := postStream(t, hc, head+"/v1/completions", map[string]any{
				"prompt": g.PromptIDs, "max_tokens": 64, "temperature": 0, "ignore_eos": true, "stream": true})
			if !s.done || s.err != "" || len(s.ids) != 64 {
				t.Fatalf("prompt %d: done %v, error %q, %d ids", i, s.done, s.err, len(s.ids))
			}
			out = append(out, s)
		}
		return out
	}

	var direct []stream
	t.Run("direct", func(t *testing.T) {
		head, _ := threeNodes(t, dir, be, "", "")
		direct = generate(head)
		for i, g := range golden {
			if fmt.Sprint(direct[i].ids[:16]) != fmt.Sprint(g.FP32.GreedyIDs[:16]) {
				t.Errorf("prompt %d: direct mesh ids %v, golden %v", i, direct[i].ids[:16], g.FP32.GreedyIDs[:16])
			}
		}
	})
	if direct == nil {
		t.FailNow()
	}
	for _, tc := range []struct{ mode, bridge, path, other string }{
		{daemon.RelayRPC, "ws", "rpc", "tunnel"},
		{daemon.RelayTunnel, "tunnel", "tunnel", "rpc"},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			relayURL, relaySrv := startRelay(t)
			head, tail := threeNodes(t, dir, be, relayURL, tc.mode)
			if tail.URL() != "" || tail.BridgeMode() != tc.bridge {
				t.Fatalf("tail: url %q, bridge %q; want no listener, bridge %q", tail.URL(), tail.BridgeMode(), tc.bridge)
			}
			got := generate(head)
			for i := range golden {
				if got[i].text != direct[i].text || fmt.Sprint(got[i].ids) != fmt.Sprint(direct[i].ids) {
					t.Errorf("prompt %d through the relay (%s):\n%q\ndirect mesh:\n%q", i, tc.mode, got[i].text, direct[i].text)
				}
			}
			// One hop per generated step reached the tail through the relay,
			// all by the mode's path.
			want := float64(len(golden) * 64)
			if n := relayRequests(t, hc, relaySrv.URL, tc.path); n < want {
				t.Errorf("relay carried %v hops by %s, want at least %v", n, tc.path, want)
			}
			if n := relayRequests(t, hc, relaySrv.URL, tc.other); n != 0 {
				t.Errorf("relay carried %v hops by %s in %s mode", n, tc.other, tc.mode)
			}
		})
	}
	// --direct-replies on the head, the tail behind the relay tunnel: the
	// tail POSTs each token to the head's endpoint (TLS pinned to its peer
	// id) as well as back along the chain; the text is the direct mesh's.
	t.Run("direct-replies", func(t *testing.T) {
		relayURL, _ := startRelay(t)
		head, _ := threeNodes(t, dir, be, relayURL, daemon.RelayTunnel, true)
		got := generate(head)
		for i := range golden {
			if got[i].text != direct[i].text || fmt.Sprint(got[i].ids) != fmt.Sprint(direct[i].ids) {
				t.Errorf("prompt %d with direct replies:\n%q\ndirect mesh:\n%q", i, got[i].text, direct[i].text)
			}
		}
		fams := metricstest.Scrape(t, hc, head+"/metrics")
		taken, _ := metricstest.Value(fams, "meshgpu_node_direct_replies_total")
		if taken < float64(len(golden)*64) {
			t.Errorf("the head waited for %v direct replies, want one per token (%d)", taken, len(golden)*64)
		}
		// The chain through the relay tunnel is the longer way back: most
		// tokens come straight from the tail.
		if first, _ := metricstest.Value(fams, "meshgpu_node_direct_replies_total", "first=direct"); first == 0 {
			t.Error("no direct reply came before its chain answer")
		}
	})
}
