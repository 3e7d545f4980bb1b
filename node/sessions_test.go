package node

import (
	"errors"
	"testing"
	"time"

	"meshgpu/native"
	"meshgpu/sample"
	"meshgpu/wire"
)

// A session whose KV allocation fails must not take down a newer session of
// the same id: a DELETE during the allocation lets a new hop at position 0
// create it again, and the failed creator then removes only its own entry.
func TestFailedCreationKeepsNewerSessionOfSameID(t *testing.T) {
	entered := make(chan struct{})
	fail := make(chan struct{})
	calls := 0
	tbl := newSessionTable(4, time.Minute, 16, func(max int) (native.Session, error) {
		calls++
		if calls == 1 {
			close(entered)
			<-fail
			return nil, errors.New("out of memory")
		}
		return &fakeSession{max: max}, nil
	})
	first := make(chan *apiError, 1)
	go func() {
		_, ae := tbl.get("x", 0)
		first <- ae
	}()
	<-entered
	removed := make(chan bool, 1)
	go func() { removed <- tbl.remove("x") }()
	for deadline := time.Now().Add(5 * time.Second); tbl.len() != 0; {
		if time.Now().After(deadline) {
			t.Fatal("DELETE did not take the session out of the table")
		}
		time.Sleep(time.Millisecond)
	}
	s2, ae := tbl.get("x", 0)
	if ae != nil {
		t.Fatalf("recreating x: %v", ae)
	}
	close(fail)
	if ae := <-first; ae == nil || ae.Status != 507 {
		t.Fatalf("failed allocation: %v, want 507", ae)
	}
	if !<-removed {
		t.Error("remove reported no session")
	}
	tbl.mu.Lock()
	got := tbl.m["x"]
	tbl.mu.Unlock()
	if got != s2 {
		t.Fatalf("the new session x is gone from the table after the old one's allocation failed (its KV cache would leak)")
	}
	tbl.closeAll()
	if !s2.kv.(*fakeSession).closed {
		t.Error("closeAll did not free the new session")
	}
}

// A path whose next hop answers 428 to two unbound hops in a row (it
// cannot keep our binding: behind a relay that names no sender) gets a
// binding on every hop; one lost binding (a restart) is sent again once.
func TestDownBindingAfterLostBindings(t *testing.T) {
	s := &session{}
	a := wire.Hop{Endpoint: "http://a", StartLayer: 1, EndLayer: 2}
	b := wire.Hop{Endpoint: "http://b", StartLayer: 1, EndLayer: 2}
	var p sample.Params
	if s.downBound(a, nil, p) {
		t.Fatal("bound before any hop")
	}
	s.setDown(true, a, nil, p, false)
	if !s.downBound(a, nil, p) || s.downBound(b, nil, p) {
		t.Fatal("after a bound hop: want a bound, b not")
	}
	s.setDown(true, a, nil, p, true) // 428, sent again
	if !s.downBound(a, nil, p) {
		t.Fatal("one lost binding: the next hop should try unbound again")
	}
	s.setDown(true, a, nil, p, false) // the unbound hop went through
	s.setDown(true, a, nil, p, true)
	if !s.downBound(a, nil, p) {
		t.Fatal("lost bindings apart: still worth trying unbound")
	}
	s.setDown(true, a, nil, p, true) // lost again, right after
	if s.downBound(a, nil, p) {
		t.Fatal("two lost bindings in a row: want a binding on every hop")
	}
	s.setDown(true, a, nil, p, false)
	if s.downBound(a, nil, p) {
		t.Fatal("a path that loses bindings must keep binding")
	}
	s.setDown(true, b, nil, p, false)
	if !s.downBound(b, nil, p) {
		t.Fatal("a new path starts bound-once again")
	}
	s.setDown(false, b, nil, p, false)
	if s.downBound(b, nil, p) {
		t.Fatal("a failed hop forgets the binding")
	}
}
