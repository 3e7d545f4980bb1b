package tracker

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"meshgpu/internal/testenv"
)

// openEtcd opens an EtcdStore on addr for the test.
func openEtcd(t *testing.T, addr, prefix string, ttl time.Duration) *EtcdStore {
	t.Helper()
	s, err := OpenEtcd(context.Background(), EtcdConfig{Endpoints: []string{addr}, Prefix: prefix, TTL: ttl,
		Self: TrackerInfo{PeerID: newIdentity(t).PeerID, URL: "http://127.0.0.1:1"}, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// Two trackers on one etcd serve one mesh: a node registered through A
// heartbeats through B, both see the same map, a ban or a failed audit
// recorded by one keeps the node out of the other's routes, a message
// accepted by one is a replay to the other, and a model's layer count is
// one for both.
func TestEtcdTwoTrackersShareState(t *testing.T) {
	testenv.CheckGoroutines(t)
	addr := testenv.Etcd(t)
	ctx := context.Background()
	sa, sb := openEtcd(t, addr, "/m1/", 5*time.Second), openEtcd(t, addr, "/m1/", 5*time.Second)
	a, tsA := startTracker(t, Config{Store: sa, HeartbeatTimeout: 5 * time.Second})
	b, tsB := startTracker(t, Config{Store: sb, HeartbeatTimeout: 5 * time.Second})
	hc := httpClient(t)
	head := &Client{URL: tsA.URL, Identity: newIdentity(t), HTTP: hc}
	spare := &Client{URL: tsB.URL, Identity: newIdentity(t), HTTP: hc}
	mustRegister(t, head, reg("http://127.0.0.1:7001", 0, 5, 6, 1))
	mustRegister(t, spare, reg("http://127.0.0.1:7002", 0, 5, 6, 1))
	head.URL = tsB.URL
	if _, err := head.Heartbeat(ctx, Heartbeat{Stats: NodeStats{TokensPerSec: 3}}); err != nil {
		t.Fatalf("heartbeat through the other tracker: %v", err)
	}
	// The other tracker's copy follows within the watch's latency.
	for _, s := range []*Server{a, b} {
		eventually(t, "both nodes and the heartbeat's stats on each tracker", func() bool {
			n, _ := s.Registry().Nodes(ctx)
			ok := len(n) == 2 && n[0].PeerID < n[1].PeerID
			for _, r := range n {
				ok = ok && (r.PeerID != head.Identity.PeerID || r.Stats.TokensPerSec == 3)
			}
			return ok
		})
	}
	var mapA, mapB AvailabilityMap
	getJSON(t, hc, tsA.URL+"/map", &mapA)
	getJSON(t, hc, tsB.URL+"/map", &mapB)
	if fmt.Sprint(mapA) != fmt.Sprint(mapB) || !mapA.Covered || mapA.Layers[0].Replicas != 2 {
		t.Fatalf("maps differ or wrong:\n%+v\n%+v", mapA, mapB)
	}

	heads := func(s *Server) map[string]int {
		out := map[string]int{}
		for seed := uint64(0); seed < 30; seed++ {
			r, err := s.Registry().Route(ctx, "gocoder-6m", seed)
			if err != nil {
				t.Fatal(err)
			}
			out[r.Hops[0].PeerID]++
		}
		return out
	}
	if h := heads(b); h[head.Identity.PeerID] == 0 || h[spare.Identity.PeerID] == 0 {
		t.Fatalf("equal replicas should share routes: %v", h)
	}
	if err := a.Registry().Ban(ctx, head.Identity.PeerID, time.Minute); err != nil {
		t.Fatal(err)
	}
	eventually(t, "tracker B to honour tracker A's ban", func() bool { return heads(b)[head.Identity.PeerID] == 0 })
	if err := b.Registry().SetStatus(ctx, NodeStatus{PeerID: spare.Identity.PeerID, Audit: AuditFailed, Detail: "test"}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "tracker A to honour tracker B's failed audit", func() bool {
		_, err := a.Registry().Route(ctx, "gocoder-6m", 0)
		return err != nil
	})

	// The same signed heartbeat to both trackers: the second is a replay.
	body, err := Sign(spare.Identity, KindHeartbeat, time.Now().Add(time.Second), &Heartbeat{})
	if err != nil {
		t.Fatal(err)
	}
	if status, out := postRaw(t, hc, tsA.URL+"/heartbeat", body); status != 200 {
		t.Fatalf("heartbeat: %d %v", status, out)
	}
	if status, _ := postRaw(t, hc, tsB.URL+"/heartbeat", body); status != 401 {
		t.Fatalf("the heartbeat replayed to the other tracker: %d, want 401", status)
	}
	// A contradicting layer count is not refused (shape.go), and both
	// trackers elect the same one: the newcomer gives way on each.
	other := &Client{URL: tsB.URL, Identity: newIdentity(t), HTTP: hc}
	if _, err = other.Register(ctx, reg("http://127.0.0.1:7003", 0, 7, 8, 1)); err != nil {
		t.Fatalf("a contradicting layer count through the other tracker: %v", err)
	}
	eventually(t, "tracker A to see the newcomer", func() bool { _, ok, _ := sa.Get(ctx, other.Identity.PeerID); return ok })
	for _, s := range []*Server{a, b} {
		if ok, why, err := s.Registry().Routable(ctx, other.Identity.PeerID); err != nil || ok || !strings.Contains(why, "with 6 layers, not 8") {
			t.Fatalf("the newcomer of 8 layers against two of 6: routable %v (%q, %v), want it giving way", ok, why, err)
		}
	}
	var tr struct{ Trackers []TrackerInfo }
	if getJSON(t, hc, tsA.URL+"/trackers", &tr); len(tr.Trackers) != 2 {
		t.Fatalf("GET /trackers lists %+v, want both trackers", tr.Trackers)
	}
}

// eventually fails t unless cond holds within two seconds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Signed messages raced to two trackers: the replay guard and the model's
// layer count are etcd compare-and-swaps, so exactly one copy of a message
// applies, and two nodes contradicting each other's layer count are never
// both routed, however the requests interleave: both trackers elect alike.
func TestEtcdRacesBetweenTrackers(t *testing.T) {
	testenv.CheckGoroutines(t)
	addr := testenv.Etcd(t)
	sa, sb := openEtcd(t, addr, "/race/", 10*time.Second), openEtcd(t, addr, "/race/", 10*time.Second)
	srvA, tsA := startTracker(t, Config{Store: sa, HeartbeatTimeout: 10 * time.Second})
	srvB, tsB := startTracker(t, Config{Store: sb, HeartbeatTimeout: 10 * time.Second})
	hc := httpClient(t)
	node := &Client{URL: tsA.URL, Identity: newIdentity(t), HTTP: hc}
	mustRegister(t, node, reg("http://127.0.0.1:7001", 0, 5, 6, 1))
	both := func(bodyA, bodyB []byte, pathA, pathB string) (int, int) {
		var wg sync.WaitGroup
		var ca, cb int
		wg.Add(2)
		go func() { defer wg.Done(); ca, _ = postRaw(t, hc, tsA.URL+pathA, bodyA) }()
		go func() { defer wg.Done(); cb, _ = postRaw(t, hc, tsB.URL+pathB, bodyB) }()
		wg.Wait()
		return ca, cb
	}
	for i := 0; i < 20; i++ {
		body, _ := Sign(node.Identity, KindHeartbeat, time.Now().Add(time.Duration(i+1)*time.Millisecond), &Heartbeat{})
		ca, cb := both(body, body, "/heartbeat", "/heartbeat")
		if (ca == 200) == (cb == 200) || ca+cb != 200+401 {
			t.Fatalf("round %d: one heartbeat raced to both trackers answered %d and %d; want one 200 and one 401", i, ca, cb)
		}
	}
	for i := 0; i < 10; i++ {
		model := fmt.Sprintf("race-%d", i)
		r6, r8 := reg(fmt.Sprintf("http://127.0.0.1:%d", 7100+2*i), 0, 5, 6, 1), reg(fmt.Sprintf("http://127.0.0.1:%d", 7101+2*i), 0, 7, 8, 1)
		r6.Model, r8.Model = model, model
		b6, _ := Sign(newIdentity(t), KindRegister, time.Now(), &r6)
		b8, _ := Sign(newIdentity(t), KindRegister, time.Now(), &r8)
		if ca, cb := both(b6, b8, "/register", "/register"); ca != 200 || cb != 200 {
			t.Fatalf("round %d: registrations of 6 and 8 layers through two trackers: %d and %d, want both 200 (neither refused)", i, ca, cb)
		}
		// Both trackers elect the same count. One node and one address
		// each is a tie: neither is routed, on either tracker; a second
		// node of 6 layers through one tracker puts 6 ahead on both.
		ids := []string{peerOf(t, b6), peerOf(t, b8)}
		routable := func() []bool {
			var seen []bool
			for _, srv := range []*Server{srvA, srvB} {
				for _, id := range ids {
					ok, _, err := srv.Registry().Routable(context.Background(), id)
					if err != nil {
						t.Fatal(err)
					}
					seen = append(seen, ok)
				}
			}
			return seen
		}
		eventually(t, "both trackers to see both nodes", func() bool { return seesAll(ids, sa, sb) })
		if seen := routable(); fmt.Sprint(seen) != "[false false false false]" {
			t.Fatalf("round %d: routable (A: 6, 8; B: 6, 8) = %v, want neither count routed on either tracker (a tie)", i, seen)
		}
		r6b := reg(fmt.Sprintf("http://127.0.0.1:%d", 7300+i), 0, 5, 6, 1)
		r6b.Model = model
		second := &Client{URL: tsB.URL, Identity: newIdentity(t), HTTP: hc}
		mustRegister(t, second, r6b)
		eventually(t, "both trackers to see the second node", func() bool { return seesAll([]string{second.Identity.PeerID}, sa, sb) })
		if seen := routable(); fmt.Sprint(seen) != "[true false true false]" {
			t.Fatalf("round %d: routable (A: 6, 8; B: 6, 8) = %v after a second node of 6, want 6 routed on both trackers", i, seen)
		}
	}
}

// seesAll reports whether every one of stores holds every one of ids.
func seesAll(ids []string, stores ...Store) bool {
	for _, st := range stores {
		for _, id := range ids {
			if _, ok, _ := st.Get(context.Background(), id); !ok {
				return false
			}
		}
	}
	return true
}

// Joiners asking two trackers at once get different ranges: the
// reservation is a compare-and-swap on the model's assign key.
func TestEtcdConcurrentAssignSpreads(t *testing.T) {
	testenv.CheckGoroutines(t)
	addr := testenv.Etcd(t)
	sa, sb := openEtcd(t, addr, "/assign/", 10*time.Second), openEtcd(t, addr, "/assign/", 10*time.Second)
	_, tsA := startTracker(t, Config{Store: sa, HeartbeatTimeout: 10 * time.Second})
	_, tsB := startTracker(t, Config{Store: sb, HeartbeatTimeout: 10 * time.Second})
	hc := httpClient(t)
	for i := 0; i < 8; i++ {
		req := AssignRequest{Model: fmt.Sprintf("m-%d", i), NumLayers: 6, MemoryBudget: 3 << 20,
			Footprint: Footprint{BytesPerLayer: 1 << 20}, MsPerLayer: 1}
		var got [2]AssignResponse
		var errs [2]error
		var wg sync.WaitGroup
		for j, u := range []string{tsA.URL, tsB.URL} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c := &Client{URL: u, Identity: newIdentity(t), HTTP: hc}
				got[j], errs[j] = c.Assign(context.Background(), req)
			}()
		}
		wg.Wait()
		if errs[0] != nil || errs[1] != nil {
			t.Fatal(errs)
		}
		if got[0].First == got[1].First {
			t.Fatalf("round %d: both joiners were assigned %d-%d by different trackers", i, got[0].First, got[0].Last)
		}
	}
}

// A node that stops heartbeating disappears from etcd by lease expiry,
// with no tracker reading or deleting it.
func TestEtcdRecordExpiresByLease(t *testing.T) {
	testenv.CheckGoroutines(t)
	addr := testenv.Etcd(t)
	s := openEtcd(t, addr, "/lease/", 2*time.Second)
	_, ts := startTracker(t, Config{Store: s, HeartbeatTimeout: 2 * time.Second})
	c := &Client{URL: ts.URL, Identity: newIdentity(t), HTTP: httpClient(t)}
	mustRegister(t, c, reg("http://127.0.0.1:7001", 0, 5, 6, 1))
	raw, err := clientv3.New(clientv3.Config{Endpoints: []string{addr}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	count := func() int64 {
		resp, err := raw.Get(context.Background(), "/lease/nodes/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		return resp.Count
	}
	// Heartbeats keep it past the lease's length.
	for i := 0; i < 6; i++ {
		time.Sleep(500 * time.Millisecond)
		if _, err := c.Heartbeat(context.Background(), Heartbeat{}); err != nil {
			t.Fatal(err)
		}
	}
	if n := count(); n != 1 {
		t.Fatalf("%d records after heartbeats, want 1", n)
	}
	deadline := time.Now().Add(10 * time.Second)
	for count() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the record is still in etcd 10s after the last heartbeat (lease 2s)")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if _, ok, _ := s.Get(context.Background(), c.Identity.PeerID); ok {
		t.Fatal("the watch did not drop the expired record from the tracker's copy")
	}
	_, err = c.Heartbeat(context.Background(), Heartbeat{})
	if !IsNotRegistered(err) {
		t.Fatalf("heartbeat after expiry: %v, want 404", err)
	}
}

// A node that names one tracker learns the mesh's others (ids, public
// keys, URLs) from heartbeat answers, and moves to one of them when its
// tracker dies; the heartbeat goes through with the shared state, no new
// registration needed.
func TestClientLearnsTrackersAndMovesOn(t *testing.T) {
	testenv.CheckGoroutines(t)
	addr := testenv.Etcd(t)
	lnA, lnB := listenLocal(t), listenLocal(t)
	urlA, urlB := "http://"+lnA.Addr().String(), "http://"+lnB.Addr().String()
	var servers []*http.Server
	for i, ln := range []net.Listener{lnA, lnB} {
		id := newIdentity(t)
		self := TrackerInfo{PeerID: id.PeerID, PublicKey: hex.EncodeToString(id.Public), URL: []string{urlA, urlB}[i]}
		s, err := OpenEtcd(context.Background(), EtcdConfig{Endpoints: []string{addr}, Prefix: "/learn/", TTL: 5 * time.Second, Self: self, Logger: quietLogger()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		hs := &http.Server{Handler: NewServer(Config{Store: s, Self: self, HeartbeatTimeout: 5 * time.Second, Logger: quietLogger(), Endpoints: AddrPolicy{AllowLoopback: true}, SkipEndpointCheck: true}).Handler()}
		go hs.Serve(ln)
		t.Cleanup(func() { hs.Close() })
		servers = append(servers, hs)
	}
	hc := httpClient(t)
	c := &Client{URL: urlA, Identity: newIdentity(t), HTTP: hc, Logger: quietLogger()}
	mustRegister(t, c, reg("http://127.0.0.1:7001", 0, 5, 6, 1))
	eventually(t, "both trackers published", func() bool {
		if _, err := c.Heartbeat(context.Background(), Heartbeat{}); err != nil {
			t.Fatal(err)
		}
		return len(c.Trackers()) == 2
	})
	for _, tr := range c.Trackers() {
		if tr.PublicKey == "" || (tr.URL != urlA && tr.URL != urlB) {
			t.Fatalf("learned tracker %+v", tr)
		}
	}
	servers[0].Close()
	hc.Transport.(*http.Transport).CloseIdleConnections()
	if _, err := c.Heartbeat(context.Background(), Heartbeat{Stats: NodeStats{Sessions: 4}}); err != nil {
		var v struct{ Nodes []NodeRecord }
		getJSON(t, hc, urlB+"/nodes", &v)
		t.Fatalf("heartbeat after tracker A closed: %v (current %s; B lists %+v)", err, c.Current(), v.Nodes)
	}
	if c.Current() != urlB {
		t.Fatalf("the client talks to %s, want the learned %s", c.Current(), urlB)
	}
}

// A tracker that accepts connections but never answers holds a node only
// for the client's HTTP timeout: the same heartbeat then goes to the next
// tracker of the mesh.
func TestClientMovesOnFromASilentTracker(t *testing.T) {
	testenv.CheckGoroutines(t)
	addr := testenv.Etcd(t)
	release := make(chan struct{})
	silent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer silent.Close()
	defer close(release)
	sa, sb := openEtcd(t, addr, "/silent/", 5*time.Second), openEtcd(t, addr, "/silent/", 5*time.Second)
	_, tsA := startTracker(t, Config{Store: sa, HeartbeatTimeout: 5 * time.Second})
	_, tsB := startTracker(t, Config{Store: sb, HeartbeatTimeout: 5 * time.Second})
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &Client{URL: tsA.URL, Fallbacks: []string{silent.URL, tsB.URL}, Identity: newIdentity(t),
		HTTP: &http.Client{Transport: tr, Timeout: 300 * time.Millisecond}, Logger: quietLogger()}
	mustRegister(t, c, reg("http://127.0.0.1:7001", 0, 5, 6, 1))
	tsA.Close() // A dies; the next is the silent one, then B
	start := time.Now()
	if _, err := c.Heartbeat(context.Background(), Heartbeat{}); err != nil {
		t.Fatalf("heartbeat: %v", err)
	}
	if took := time.Since(start); c.Current() != tsB.URL || took > 2*time.Second {
		t.Fatalf("the heartbeat went to %s after %v; want %s within the 300ms timeout (plus B's answer)", c.Current(), took, tsB.URL)
	}
}

// peerOf is the peer id a signed body names.
func peerOf(t *testing.T, body []byte) string {
	t.Helper()
	var a Auth
	if err := json.Unmarshal(body, &a); err != nil {
		t.Fatal(err)
	}
	return a.PeerID
}
