package node

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/ticket"
	"meshgpu/wire"
)

// One route ticket opens at most its choices' sessions (the issue: a
// ticket opened ID:N for any N, 100 digits too, and 8 of them bound all of
// a tail's slots): a head holding a valid two-choice ticket binds ID:0 to
// ID:99 (and look-alikes) on a tail with 8 slots; two sessions open, the
// rest are refused 403, and a legitimate session still runs.
func TestOneTicketOpensAtMostItsSessions(t *testing.T) {
	testenv.CheckGoroutines(t)
	head, headID := fakeHead(t)
	tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail", MaxSessions: 8, TrustedHeads: []string{headID.PeerID}}
	url := startNode(t, tail)
	route := []wire.Hop{{Endpoint: url, StartLayer: 3, EndLayer: 5, PeerID: "tail"}}
	pass := passString(t, signTicketFor(t, headID.Private, headID.PeerID, "s", route, 2, time.Minute), [][]byte{make([]byte, 32)})
	ids := []string{"s", "s:" + strings.Repeat("1", 100), "s:01", "s:-1"}
	for i := range 100 {
		ids = append(ids, fmt.Sprintf("s:%d", i))
	}
	opened := 0
	for _, id := range ids {
		hop := hopReq{session: id, n: 1, hidden: fkHidden, dtype: native.F32, start: 3, end: 5,
			header: map[string]string{wire.HeaderTicket: pass}}
		switch st, _, b := hop.send(t, http.DefaultClient, url); st {
		case http.StatusOK:
			opened++
		case http.StatusForbidden, http.StatusBadRequest:
		default:
			t.Fatalf("session %.20s: HTTP %d %s", id, st, b)
		}
	}
	if n := tail.sessions.len(); opened != 2 || n != 2 {
		t.Fatalf("one two-choice ticket opened %d sessions (%d held); want 2", opened, n)
	}
	p, _ := ticketedPipeline(t, head, route)
	got, ae := sixSteps(p)
	if ae != nil || !equalIDs(got, sixStepsWant(), 6) {
		t.Fatalf("legitimate session after the attack: %v %v, want %v", got, ae, sixStepsWant())
	}
}

// Sessions die with their ticket (the issue: they outlived it by the
// 10-minute idle TTL): once a session's ticket is past its expiry and the
// skew, its next hop (unbound, on the hop connection that bound it) is
// refused 403 ticket_expired and the session is gone; a session nobody
// touches is freed by the reaper though it is not idle for the TTL.
func TestSessionsDieWithTheirTicket(t *testing.T) {
	testenv.CheckGoroutines(t)
	_, headID := fakeHead(t)
	tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail", MaxSessions: 4,
		TrustedHeads: []string{headID.PeerID}, SessionTTL: time.Hour}
	url := startNode(t, tail)
	route := []wire.Hop{{Endpoint: url, StartLayer: 3, EndLayer: 5, PeerID: "tail"}}
	// Valid for another 3 s (expired 30 s minus 3 s ago, within the skew):
	// room for two bindings and a hop, the first dial included, on a
	// loaded runner or under -race.
	left := 3 * time.Second
	raw := signTicketFor(t, headID.Private, headID.PeerID, "d", route, 2, -(ticket.DefaultMaxSkew - left))
	pass, err := ticket.Pass{Ticket: raw, Keys: [][]byte{make([]byte, 32)}}.Encode()
	if err != nil {
		t.Fatal(err)
	}
	hc := &HopClient{Logger: quietLogger()}
	defer hc.Close()
	frame := func(id string, pos int, b *wire.Binding) *wire.HopReply {
		t.Helper()
		rep, err := hc.Do(context.Background(), url, &wire.HopHead{Session: id, Position: pos, NTokens: 1, Hidden: fkHidden, DType: wire.DTypeF32,
			Deadline: time.Now().Add(5 * time.Second), Binding: b}, make([]byte, fkHidden*4), nil)
		if err != nil {
			t.Fatalf("hop %s at %d: %v", id, pos, err)
		}
		return rep
	}
	for _, id := range []string{"d:0", "d:1"} {
		if rep := frame(id, 0, &wire.Binding{StartLayer: 3, EndLayer: 5, Ticket: pass}); rep.Status != http.StatusOK {
			t.Fatalf("binding %s under a valid ticket: %d %s", id, rep.Status, rep.Body)
		}
	}
	if rep := frame("d:0", 1, nil); rep.Status != http.StatusOK {
		t.Fatalf("unbound hop while the ticket is valid: %d %s", rep.Status, rep.Body)
	}
	time.Sleep(left + 100*time.Millisecond)
	rep := frame("d:0", 2, nil)
	if rep.Status != http.StatusForbidden || !strings.Contains(string(rep.Body), wire.TypeTicketExpired) {
		t.Fatalf("hop after the ticket expired: %d %s; want 403 %s", rep.Status, rep.Body, wire.TypeTicketExpired)
	}
	if tail.sessions.lookup("d:0") != nil {
		t.Fatal("the session outlived its refused hop")
	}
	if n := tail.sessions.reap(); n != 1 || tail.sessions.len() != 0 {
		t.Fatalf("reaper freed %d sessions, %d left; want the expired ticket's last session freed", n, tail.sessions.len())
	}
}
