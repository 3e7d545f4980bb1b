package node

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"meshgpu/native"
	"meshgpu/sample"
	"meshgpu/ticket"
	"meshgpu/wire"
)

// session is one sequence's KV cache on this node. lock (a one-slot channel,
// so waiting can honour a deadline) serializes the hops of one session.
type session struct {
	id      string
	lock    chan struct{}
	kv      native.Session
	history []int32 // ids at positions 0..len-1, for the repetition penalty (last node and head)
	// tree is the token tree the session's last hop ran (its slots
	// tree.pos..tree.pos+tree.rows-1), whose branch the next hop may keep
	// (node/spectree.go); rows 0: none. Under lock.
	tree     struct{ pos, rows int }
	lastUsed atomic.Int64 // unix nanoseconds of the last hop
	closed   bool         // set under lock once removed; a hop that finds it gets 404
	// binding is what the session's hops run under (layers, route,
	// sampling), from the hop that bound it; read and set under lock.
	binding *wire.Binding
	// down is the binding the next hop last acknowledged, so per-token hops
	// go without it; nil after a failed hop.
	down atomic.Pointer[downBinding]
	// Ownership (node/tickets.go): local sessions are the
	// head's own; key is the owner's session key (nil: unticketed); conn
	// is the sender (hop connection, or peer through the relay tunnel) that
	// last bound it; prev the peer sending its hops (conn and prev under lock).
	local atomic.Bool            // read without the lock: a hop never waits for the head's own session
	key   atomic.Pointer[[]byte] // set once; read without the lock by DELETE
	conn  *wire.HopSender
	prev  string
	// verified is the pass this session's owner last bound with, checked
	// (node/tickets.go reuseVerified).
	verified atomic.Pointer[hopGrant]
	// lastPass is the last ordered pass run here (node/inflight.go) and
	// passAdvanced closes when it changes; both under lock.
	lastPass     uint32
	passAdvanced chan struct{}
	// ends is what the node knows of the backend's token history of kv
	// (node/backendsample.go); under lock.
	ends endsHistory
}

// downBinding is a binding sent down the route: to hop, with rest after it.
type downBinding struct {
	hop    wire.Hop
	rest   []wire.Hop
	params sample.Params
	// losses counts the 428s the next hop answered to our unbound hops in
	// a row; at two it cannot keep a binding from us (e.g. behind a relay
	// that names no sender), and every hop binds on this path.
	losses int
}

func (d *downBinding) same(hop wire.Hop, rest []wire.Hop, p sample.Params) bool {
	return d != nil && d.hop == hop && d.params.Equal(p) && slices.Equal(d.rest, rest)
}

// downBound reports whether the next hop holds this binding already.
func (s *session) downBound(hop wire.Hop, rest []wire.Hop, p sample.Params) bool {
	d := s.down.Load()
	return d.same(hop, rest, p) && d.losses < 2
}

// setDown records (or, with ok false, forgets) that the next hop holds the
// binding; lost says it had to be sent again after a 428.
func (s *session) setDown(ok bool, hop wire.Hop, rest []wire.Hop, p sample.Params, lost bool) {
	d := s.down.Load()
	losses := 0
	if lost {
		losses = 1
		if d.same(hop, rest, p) {
			losses = d.losses + 1
		}
	}
	switch {
	case !ok:
		s.down.Store(nil)
	case d.same(hop, rest, p) && (d.losses >= 2 || d.losses == losses):
		// unchanged (a path that lost its binding twice keeps binding)
	default:
		s.down.Store(&downBinding{hop: hop, rest: rest, params: p, losses: losses})
	}
}

// acquire takes the session's lock or gives up when ctx ends.
func (s *session) acquire(ctx context.Context) error {
	select {
	case s.lock <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *session) release() { <-s.lock }

func (s *session) touch(now time.Time) { s.lastUsed.Store(now.UnixNano()) }

// ticketExpired reports whether the ticket the session was claimed under
// has expired at now, past the tolerated skew.
func (s *session) ticketExpired(now time.Time) bool {
	v := s.verified.Load()
	return v != nil && now.After(v.expiry.Add(ticket.DefaultMaxSkew))
}

// recordTokens keeps the ids below pos and appends the ids fed at pos.
func (s *session) recordTokens(pos int, ids []int32) {
	s.ends.changed(pos)
	if pos < len(s.history) {
		s.history = s.history[:pos]
	}
	if pos == len(s.history) {
		s.history = append(s.history, ids...)
	}
}

// sessionTable owns every session of a server: creation under capacity
// limits, lookup, deletion and the idle reaper.
type sessionTable struct {
	mu         sync.Mutex
	m          map[string]*session
	max        int
	ttl        time.Duration
	maxContext int
	newKV      func(maxTokens int) (native.Session, error)
	now        func() time.Time
}

func newSessionTable(max int, ttl time.Duration, maxContext int, newKV func(int) (native.Session, error)) *sessionTable {
	return &sessionTable{m: make(map[string]*session), max: max, ttl: ttl, maxContext: maxContext, newKV: newKV, now: time.Now}
}

func (t *sessionTable) len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m)
}

// get returns the session id, creating it when pos is 0. It does not lock the
// session. Errors: 404 unknown session at pos > 0, 429 table full, 507 no
// memory for the KV cache.
func (t *sessionTable) get(id string, pos int) (*session, *apiError) {
	return t.getSized(id, pos, t.maxContext)
}

// getSized is get with the KV cache of a new session sized for maxTokens
// (the head knows prompt + max_tokens; hops size for the whole context).
func (t *sessionTable) getSized(id string, pos, maxTokens int) (*session, *apiError) {
	if maxTokens <= 0 || maxTokens > t.maxContext {
		maxTokens = t.maxContext
	}
	t.mu.Lock()
	s, ok := t.m[id]
	if ok {
		s.touch(t.now())
		t.mu.Unlock()
		return s, nil
	}
	if pos > 0 {
		t.mu.Unlock()
		return nil, &apiError{Status: http.StatusNotFound, Type: "unknown_session",
			Message: fmt.Sprintf("session %q is not on this node (expired, deleted, or never started at position 0); got position %d", id, pos)}
	}
	if len(t.m) >= t.max {
		t.mu.Unlock()
		return nil, &apiError{Status: http.StatusTooManyRequests, Type: "too_many_sessions",
			Message: fmt.Sprintf("this node holds its maximum of %d sessions; retry later or use another node", t.max)}
	}
	// Reserve the slot so concurrent creators cannot exceed max, then
	// allocate the cache outside the table lock.
	s = &session{id: id, lock: make(chan struct{}, 1)}
	s.touch(t.now())
	s.lock <- struct{}{} // held until the KV cache exists
	t.m[id] = s
	t.mu.Unlock()

	kv, err := t.newKV(maxTokens)
	if err != nil {
		t.drop(s) // no cache to free; only its own entry goes
		s.release()
		return nil, &apiError{Status: http.StatusInsufficientStorage, Type: "kv_cache_full",
			Message: fmt.Sprintf("no memory for a %d-token KV cache: %v", maxTokens, err)}
	}
	s.kv = kv
	s.release()
	return s, nil
}

// lookup returns session id, or nil; it creates nothing.
func (t *sessionTable) lookup(id string) *session {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.m[id]
}

// remove deletes id from the table at once (a new session may take the id)
// and frees its cache once no hop holds it. It reports whether this call
// removed it.
func (t *sessionTable) remove(id string) bool {
	s := t.lookup(id)
	if s == nil || !t.unlink(s) {
		return false
	}
	// Wait for an in-flight hop: its work must finish before the cache goes.
	s.lock <- struct{}{}
	defer s.release()
	t.drop(s)
	return true
}

// drop removes s, whose lock the caller holds, and frees its cache now; a
// hop waiting for the lock then finds it closed. Every removal (remove,
// reap, a refused hop) frees the cache here. It reports whether s was
// still in the table.
func (t *sessionTable) drop(s *session) bool {
	held := t.unlink(s)
	s.close()
	return held
}

// unlink takes s out of the table if it is still there (a DELETE and a new
// hop may have replaced it) and reports whether it was.
func (t *sessionTable) unlink(s *session) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m[s.id] != s {
		return false
	}
	delete(t.m, s.id)
	return true
}

func (s *session) close() {
	if !s.closed {
		s.closed = true
		if s.kv != nil {
			s.kv.Close()
		}
	}
}

// reap frees the sessions no hop holds that are idle for longer than the
// TTL or whose ticket has expired.
func (t *sessionTable) reap() int {
	now := t.now()
	cutoff := now.Add(-t.ttl)
	var idle []*session
	t.mu.Lock()
	for _, s := range t.m {
		if s.lastUsed.Load() < cutoff.UnixNano() || s.ticketExpired(now) {
			select {
			case s.lock <- struct{}{}: // not in use
				idle = append(idle, s)
			default:
			}
		}
	}
	t.mu.Unlock()
	n := 0
	for _, s := range idle {
		if t.drop(s) {
			n++
		}
		s.release()
	}
	return n
}

// closeAll frees every session (server shutdown).
func (t *sessionTable) closeAll() {
	t.mu.Lock()
	ids := make([]string, 0, len(t.m))
	for id := range t.m {
		ids = append(ids, id)
	}
	t.mu.Unlock()
	for _, id := range ids {
		t.remove(id)
	}
}

// sampleWithHistory samples from logits using the session's history for the
// penalties and the response format, and computes the token's logprobs when
// p asks for them.
func (srv *Server) sampleWithHistory(logits []float32, p sample.Params, s *session, step int) (int32, float32, *sample.TokenLogprobs, *apiError) {
	if !finiteLogits(logits) {
		// Never a token from NaN: sampling would pick token 0.
		return 0, 0, nil, errNonFiniteLogits()
	}
	var hist []int32
	if p.NeedsHistory() {
		hist = s.history
	}
	if len(p.ResponseFormat) > 0 {
		if ae := srv.maskFormat(logits, p, hist, step); ae != nil {
			return 0, 0, nil, ae
		}
	}
	id, lp := sample.Sample(logits, p, hist, step)
	if !p.Logprobs {
		return id, lp, nil, nil
	}
	l := sample.Logprobs(logits, id, p.TopLogprobs)
	// A token the format masked (-Inf) cannot be drawn: no alternative.
	// Every logprob that leaves is finite (wire.TokenReply.Check).
	l.Top = slices.DeleteFunc(l.Top, func(c sample.Candidate) bool { return math.IsInf(float64(c.Logprob), -1) })
	return id, lp, &l, nil
}

// awaitPass, called with the session's lock held, orders pass o of the
// session: it waits, the lock let go, until the pass o builds on has run
// here (an earlier pass still on its way), bounded by ctx; it refuses a
// pass below one that ran (its head dropped it, and running it would
// overwrite the cache of the later one) and, once passes are ordered, an
// unordered hop. The same pass again is a retry of its redo, which the
// position rule makes harmless. held reports whether the lock is held on
// return.
func (s *session) awaitPass(ctx context.Context, o wire.PassOrder) (held bool, ae *apiError) {
	for {
		switch {
		case !o.Set():
			return true, &apiError{Status: http.StatusConflict, Type: wire.TypeStalePass,
				Message: fmt.Sprintf("session %s runs ordered passes (pass %d ran here); this hop has no pass order", s.id, s.lastPass)}
		case o.Seq < s.lastPass:
			return true, &apiError{Status: http.StatusConflict, Type: wire.TypeStalePass,
				Message: fmt.Sprintf("pass %d of session %s arrived after pass %d ran here; a pass cannot overtake a later one", o.Seq, s.id, s.lastPass)}
		case o.After <= s.lastPass:
			return true, nil
		}
		if s.passAdvanced == nil {
			s.passAdvanced = make(chan struct{})
		}
		advanced, last := s.passAdvanced, s.lastPass
		s.release()
		select {
		case <-advanced:
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.Canceled) {
				return false, errPassCanceled(o)
			}
			return false, &apiError{Status: http.StatusGatewayTimeout, Type: "hop_timeout",
				Message: fmt.Sprintf("pass %d of session %s builds on pass %d, which did not reach this node in time (the last here: %d)", o.Seq, s.id, o.After, last)}
		}
		if err := s.acquire(ctx); err != nil {
			if errors.Is(err, context.Canceled) {
				return false, errPassCanceled(o)
			}
			return false, &apiError{Status: http.StatusGatewayTimeout, Type: "hop_timeout",
				Message: "timed out waiting for the previous hop of session " + s.id}
		}
		if s.closed {
			return true, &apiError{Status: http.StatusNotFound, Type: "unknown_session", Message: "session " + s.id + " was deleted"}
		}
	}
}

// errPassCanceled: the head dropped pass o (and cancelled its hop) while
// it waited here.
func errPassCanceled(o wire.PassOrder) *apiError {
	return &apiError{Status: 499, Type: "canceled", Message: fmt.Sprintf("pass %d was canceled by its sender", o.Seq)}
}

// passRan records, under lock, that ordered pass o ran here.
func (s *session) passRan(o wire.PassOrder) {
	if !o.Set() || o.Seq == s.lastPass {
		return
	}
	s.lastPass = o.Seq
	if s.passAdvanced != nil {
		close(s.passAdvanced)
		s.passAdvanced = nil
	}
}
