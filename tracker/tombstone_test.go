package tracker

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"
)

// A registration or heartbeat signed before a node's goodbye and arriving
// after it (the announcer's last message, still on the wire) is refused:
// the node stays gone. One signed after the goodbye registers it again.
func TestMessageSignedBeforeDeregisterIsRefused(t *testing.T) {
	m := newProxyMesh(t, Config{})
	c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	r := reg("http://127.0.0.1:3", 0, 5, 6, 1)
	mustRegister(t, c, r)
	m.clk.Add(time.Millisecond)
	early, err := Sign(c.Identity, KindRegister, m.clk.Now(), &r)
	if err != nil {
		t.Fatal(err)
	}
	m.clk.Add(time.Millisecond)
	if err := c.Deregister(context.Background()); err != nil {
		t.Fatalf("deregister: %v", err)
	}
	resp, err := m.hc.Post(m.tracker.URL+"/register", "application/json", strings.NewReader(string(early)))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var nodes struct{ Nodes []PublicNode }
	getJSON(t, m.hc, m.tracker.URL+"/nodes", &nodes)
	if resp.StatusCode != 401 || len(nodes.Nodes) != 0 {
		t.Fatalf("registration signed before the goodbye: %d %s, %d nodes; want 401 and none", resp.StatusCode, b, len(nodes.Nodes))
	}
	m.clk.Add(time.Millisecond)
	mustRegister(t, c, r)
	getJSON(t, m.hc, m.tracker.URL+"/nodes", &nodes)
	if len(nodes.Nodes) != 1 {
		t.Fatalf("registration after the goodbye: %d nodes, want 1", len(nodes.Nodes))
	}
}
