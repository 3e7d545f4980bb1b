package tracker

import (
	"sync"
	"testing"
	"time"

	"meshgpu/internal/testenv"
)

// A head that takes route tickets and answers 429 forever (the issue: it
// was sent a fresh ticket about every 0.5 s, per client) gets fewer, not
// more: every busy answer without a finished generation doubles how long
// the tracker avoids it, across clients. Four clients for two rounds, each
// willing to wait 3 s, send it a number of tickets that grows with the log
// of the wait, where a fixed 200 ms retry sent about 15 per client and
// round; no client gets an answer other than 429 and the head is not banned.
func TestBusyForeverHeadGetsFewerTickets(t *testing.T) {
	testenv.CheckGoroutines(t)
	const wait = 3 * time.Second
	m := newProxyMesh(t, Config{BusyWait: wait})
	head := &fakeHead{t: t, fail: func(headCall) (int, string, string) { return 0, "429", "" }}
	h := startHead(t, head)
	m.node(t, h.URL, 0, 5, 1)
	const clients, rounds = 4, 2
	for range rounds {
		var wg sync.WaitGroup
		for range clients {
			wg.Go(func() {
				resp := m.post(t, "/v1/chat/completions", chatBody)
				resp.Body.Close()
				if resp.StatusCode != 429 {
					t.Errorf("client of an always-busy head: HTTP %d, want 429", resp.StatusCode)
				}
			})
		}
		wg.Wait()
	}
	// Doubling from 200 ms, a client's own attempts within 3 s are at most
	// 1 + log2(3 s / 200 ms) < 5; shared, the four clients' are fewer.
	calls := len(head.Calls())
	t.Logf("%d tickets to the busy head for %d clients x %d rounds", calls, clients, rounds)
	if max := clients * 5; calls > max {
		t.Errorf("the always-busy head was sent %d tickets; want at most %d", calls, max)
	}
	if bans, err := m.srv.reg.Store().Bans(t.Context(), m.clk.Now()); err != nil || len(bans) != 0 {
		t.Fatalf("bans after back-pressure: %v %v", bans, err)
	}
}

// A generation that outlives its route ticket (sessions die with their
// ticket, node/tickets.go) resumes on a new ticket after its tokens, with
// no ban and no attempt spent, when the ticket has expired by the
// tracker's clock; a head or hop claiming ticket_expired for a ticket that
// has not expired is not excused: the hop it names is banned.
func TestExpiredTicketRenewsWithoutBan(t *testing.T) {
	testenv.CheckGoroutines(t)
	want := reference(t, "/v1/chat/completions", chatBody, true)
	for _, expired := range []bool{true, false} {
		m := newProxyMesh(t, Config{MaxAttempts: 1, TicketTTL: time.Second})
		var tailURL string
		var calls int
		var mu sync.Mutex
		head := &fakeHead{t: t, fail: func(headCall) (int, string, string) {
			mu.Lock()
			defer mu.Unlock()
			if calls++; calls == 1 {
				if expired {
					m.clk.Add(2 * time.Second) // the generation ran past the ticket
				}
				return 3, "expired-event", tailURL
			}
			return -1, "", ""
		}}
		h := startHead(t, head)
		m.node(t, h.URL, 0, 2, 1)
		tailURL = "http://127.0.0.1:1"
		tail := m.node(t, tailURL, 3, 5, 1)
		got := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
		bans, err := m.srv.reg.Store().Bans(t.Context(), m.clk.Now())
		if err != nil {
			t.Fatal(err)
		}
		hc := head.Calls()
		if expired {
			if !got.done || got.errored != "" || got.text != want.text || len(bans) != 0 {
				t.Fatalf("expired ticket: %+v, bans %v; want the whole text and no ban", got, bans)
			}
			if len(hc) != 2 || len(hc[1].continueIDs) != 3 || hc[1].ticket == hc[0].ticket {
				t.Fatalf("head calls %+v: want a resume after 3 tokens on a new ticket", hc)
			}
			continue
		}
		if _, banned := bans[tail]; got.done || len(bans) != 1 || !banned {
			t.Fatalf("ticket_expired for a live ticket: %+v, bans %v; want the named tail banned", got, bans)
		}
	}
}

// The attack: a head answers every ticket with back-pressure naming an
// honest tail ("too_many_sessions", hop: the tail). The shared backoff used
// to be charged to the hop the head named, so every generation avoided
// the tail, doubling up to a minute, and a model with one tail was locked
// out. Which hop was busy is the head's word: it binds the generation that
// heard it, and the shared backoff is charged to the head. After the liar
// has answered four clients, an honest head's chats through the same tail
// succeed, and nobody is banned.
func TestHeadNamingABusyTailDoesNotLockItOut(t *testing.T) {
	testenv.CheckGoroutines(t)
	want := reference(t, "/v1/chat/completions", chatBody, true)
	m := newProxyMesh(t, Config{BusyWait: time.Second})
	const tailURL = "http://127.0.0.1:1" // fake heads run every layer themselves
	liar := &fakeHead{t: t, fail: func(headCall) (int, string, string) { return 0, "busy-event", tailURL }}
	m.node(t, startHead(t, liar).URL, 0, 2, 1)
	m.node(t, tailURL, 3, 5, 1)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			if got := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true); got.done {
				t.Errorf("a chat through the lying head finished: %+v", got)
			}
		})
	}
	wg.Wait()
	if len(liar.Calls()) == 0 {
		t.Fatal("the lying head got no request")
	}
	honest := &fakeHead{t: t}
	m.node(t, startHead(t, honest).URL, 0, 2, 1)
	for range 3 {
		if got := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true); !got.done || got.errored != "" || got.text != want.text {
			t.Fatalf("chat after the lying head named the tail busy: %+v, want %q (the tail is locked out)", got, want.text)
		}
	}
	if len(honest.Calls()) == 0 {
		t.Fatal("the honest head got no request")
	}
	if bans, err := m.srv.reg.Store().Bans(t.Context(), m.clk.Now()); err != nil || len(bans) != 0 {
		t.Fatalf("bans after back-pressure: %v %v", bans, err)
	}
}
