package node

import (
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"testing"
	"time"

	"meshgpu/internal/metricstest"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/wire"
)

// inFlightCounts scrapes a head's passes in flight (the gauge) and the
// passes it dropped after rollbacks.
func (g *specMesh) inFlightCounts(t *testing.T, c *http.Client, mode wire.SpeculateMode) (inFlight, dropped float64) {
	t.Helper()
	fams := metricstest.Scrape(t, c, g.urls[mode]+"/metrics")
	inFlight, _ = metricstest.Value(fams, "meshgpu_node_speculative_passes_in_flight")
	dropped, _ = metricstest.Value(fams, "meshgpu_node_speculative_dropped_passes_total")
	return inFlight, dropped
}

// A node runs a session's ordered passes in order whatever order they
// arrive in: a pass that overtook the pass it builds on waits for it (and
// runs after it, at the position it left), one below a pass that ran (a
// head's dropped pass, arriving late; or an attacker replaying one) is
// refused with 409 stale_pass before it computes, as is an unordered hop
// once passes are ordered; a pass whose predecessor never comes fails at
// its deadline. Without the order the overtaking pass would find the
// cache short (409 position_mismatch) and the late one would overwrite
// the cache of the pass after it.
func TestPassesRunInOrder(t *testing.T) {
	testenv.CheckGoroutines(t)
	stack := newFakeStack(5, 5, fkLayers, fkHidden, fkVocab)
	tail := &Server{StackForTesting: stack, PeerID: "tail", Logger: quietLogger()}
	url := startNode(t, tail)
	c := &http.Client{Timeout: 10 * time.Second}
	defer c.CloseIdleConnections()
	const id = "ordered"
	hop := func(pos int, order string, tokens ...int32) hopReq {
		h := hopReq{session: id, n: len(tokens), hidden: fkHidden, dtype: native.F32, start: 5, end: -1, pos: pos, tokens: tokens,
			header: map[string]string{}}
		if order != "" {
			h.header[wire.HeaderPass] = order
		}
		return h
	}
	token := func(code int, body []byte) int32 {
		t.Helper()
		var r wire.TokenReply
		if code != http.StatusOK || json.Unmarshal(body, &r) != nil {
			t.Fatalf("hop answered %d %s", code, body)
		}
		return r.Token
	}
	// The prompt (unordered), then pass 2 before pass 1.
	if tok := token(func() (int, []byte) { code, _, b := hop(0, "", 10).send(t, c, url); return code, b }()); tok != 11 {
		t.Fatalf("prefill: token %d, want 11", tok)
	}
	type answer struct {
		code int
		body []byte
	}
	second := make(chan answer, 1)
	go func() {
		code, _, b := hop(2, "2,1", 30).send(t, c, url)
		second <- answer{code, b}
	}()
	if tok := token(func() (int, []byte) { code, _, b := hop(1, "1,0", 20).send(t, c, url); return code, b }()); tok != 21 {
		t.Fatalf("pass 1: token %d, want 21", tok)
	}
	a := <-second
	if tok := token(a.code, a.body); tok != 31 {
		t.Fatalf("pass 2 (sent before pass 1): token %d, want 31", tok)
	}
	tail.sessions.mu.Lock()
	sess := tail.sessions.m[id]
	tail.sessions.mu.Unlock()
	held := func() int { // under the session's lock
		sess.acquire(context.Background())
		defer sess.release()
		return sess.kv.Len()
	}
	forwards := func() int {
		stack.mu.Lock()
		defer stack.mu.Unlock()
		return stack.forwards
	}
	if n := held(); n != 3 {
		t.Fatalf("the session holds %d positions, want 3 (the prompt, pass 1, pass 2)", n)
	}
	ran := forwards()
	for name, h := range map[string]hopReq{
		"pass 1 again (after pass 2 ran)": hop(1, "1,0", 99),
		"unordered hop":                   hop(1, "", 99),
	} {
		code, hd, body := h.send(t, c, url)
		if ae := decodeError(t, code, hd, body); code != http.StatusConflict || ae.Type != wire.TypeStalePass {
			t.Errorf("%s: %d %s, want 409 %s", name, code, body, wire.TypeStalePass)
		}
	}
	for name, v := range map[string]string{"zero": "0,0", "after itself": "3,3", "garbage": "x"} {
		code, hd, body := hop(3, v, 40).send(t, c, url)
		if ae := decodeError(t, code, hd, body); code != http.StatusBadRequest || ae.Type != "invalid_header" {
			t.Errorf("pass order %s: %d %s, want 400 invalid_header", name, code, body)
		}
	}
	if n := forwards(); n != ran {
		t.Errorf("refused passes ran %d forwards", n-ran)
	}
	// A pass whose predecessor never comes gives up at its deadline.
	h := hop(3, "9,8", 40)
	h.header[wire.HeaderHopDeadline] = strconv.FormatInt(time.Now().Add(300*time.Millisecond).UnixMilli(), 10)
	if code, hd, body := h.send(t, c, url); decodeError(t, code, hd, body).Type != "hop_timeout" {
		t.Errorf("a pass after one that never came: %d %s, want hop_timeout", code, body)
	}
	// A rollback: pass 5 builds on pass 1 (passes 3 and 4 were dropped by
	// the head), at the position pass 1 left; a late pass 3 is then stale.
	if tok := token(func() (int, []byte) { code, _, b := hop(2, "5,1", 50).send(t, c, url); return code, b }()); tok != 51 {
		t.Fatalf("rollback pass: token %d, want 51", tok)
	}
	if code, hd, body := hop(3, "3,2", 60).send(t, c, url); decodeError(t, code, hd, body).Type != wire.TypeStalePass {
		t.Errorf("a dropped pass after the rollback: %d %s, want %s", code, body, wire.TypeStalePass)
	}
	if n := held(); n != 3 {
		t.Errorf("the session holds %d positions, want 3 (the rollback pass's)", n)
	}
}

// The window's size: one pass before any answer; then as many as fit in a
// round, no more than acceptance makes worth sending, never over the
// bound; a forced size (tests) is still bounded.
func TestPassWindowSize(t *testing.T) {
	w := newPassWindow(nil, 8, 0)
	if n := w.want(); n != 1 {
		t.Fatalf("before any answer: %d passes, want 1", n)
	}
	for _, c := range []struct {
		round, compute, hit float64
		want                int
	}{
		{0.040, 0.001, 0.99, 8},   // a long round, every guess right: the bound
		{0.040, 0.001, 0.9, 8},    // 1 + log(0.3)/log(0.9) = 12, bounded
		{0.040, 0.001, 0.6, 3},    // 1 + 2.36
		{0.040, 0.001, 0.2, 1},    // guesses mostly wrong: one at a time
		{0.003, 0.001, 0.99, 3},   // a short round fits three
		{0.0005, 0.001, 0.99, 1},  // compute-bound: one
		{0.040, 0.00001, 0.99, 8}, // compute too small to measure
	} {
		w.rounds, w.round, w.compute, w.hit = 1, c.round, c.compute, c.hit
		if n := w.want(); n != c.want {
			t.Errorf("round %v, compute %v, hit %v: %d passes, want %d", c.round, c.compute, c.hit, n, c.want)
		}
	}
	if n := newPassWindow(nil, 4, 9).want(); n != 4 {
		t.Errorf("forced 9 under a bound of 4: %d", n)
	}
	if n := (&Server{SpeculateInFlight: 1000}).speculateInFlight(); n != MaxSpeculateInFlight {
		t.Errorf("SpeculateInFlight 1000: %d passes, want the bound %d", n, MaxSpeculateInFlight)
	}
}
