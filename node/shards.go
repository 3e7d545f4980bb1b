package node

import (
	"context"
	"net/http"
	"slices"
	"sync"

	"meshgpu/hopmux"
	"meshgpu/wire"
)

// Shards is the set of Servers a node process runs, one per layer range
// loaded: the current one and, after a move, the retiring ones that still
// serve their sessions (daemon.Node moves them). It implements
// hopmux.Handler: a hop of a session a retiring Server holds goes there,
// every other to the current one, which is held (Hold) until the hop is
// done, so the hop goes from the mux to its Server with no detour.
type Shards struct {
	mu       sync.Mutex
	cur      *Server
	retiring []*Server
}

// Set makes cur the current Server and retiring the retiring ones (nil:
// none; the node is closing).
func (sh *Shards) Set(cur *Server, retiring []*Server) {
	sh.mu.Lock()
	sh.cur, sh.retiring = cur, slices.Clone(retiring)
	sh.mu.Unlock()
}

// Pick is the Server holding session sid when a retiring one does (and
// existing is set), else the current one; nil while closing.
func (sh *Shards) Pick(sid string, existing bool) *Server {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if existing && sid != "" {
		for _, s := range sh.retiring {
			if s.HasSession(sid) {
				return s
			}
		}
	}
	return sh.cur
}

// AcceptHop implements hopmux.Handler for hop connections and the relay
// tunnel: the hop holds the Server it picked until it is done.
func (sh *Shards) AcceptHop(ctx context.Context, h *wire.HopHead) hopmux.Hop {
	for {
		s := sh.Pick(h.Session, h.Position != 0)
		if s == nil {
			return hopmux.Refuse(&wire.HopReply{Status: http.StatusServiceUnavailable, Kind: wire.ReplyError,
				Body: []byte(`{"error":{"message":"node is shutting down","type":"shutting_down"}}`)})
		}
		if s.Hold() {
			return s.acceptHop(ctx, h, s.Release)
		}
		// It began draining between Pick and Hold; pick again.
	}
}

// hold counts what is being served on a Server that its owner may drain
// (Shards: a retiring layer range closes once its requests are done).
type hold struct {
	mu       sync.Mutex
	active   int
	draining bool
	idle     *sync.Cond // on mu; made on first use
}

// Hold counts one request or hop on s until Release; false once s drains.
func (s *Server) Hold() bool {
	s.held.mu.Lock()
	defer s.held.mu.Unlock()
	if s.held.draining {
		return false
	}
	s.held.active++
	return true
}

// Release ends what Hold counted.
func (s *Server) Release() {
	s.held.mu.Lock()
	s.held.active--
	if s.held.active == 0 && s.held.idle != nil {
		s.held.idle.Broadcast()
	}
	s.held.mu.Unlock()
}

// Drain refuses new holds and waits for the held ones to be released
// (each request and hop has its own deadline).
func (s *Server) Drain() {
	s.held.mu.Lock()
	s.held.draining = true
	if s.held.idle == nil {
		s.held.idle = sync.NewCond(&s.held.mu)
	}
	for s.held.active > 0 {
		s.held.idle.Wait()
	}
	s.held.mu.Unlock()
}
