package relay

import (
	"fmt"
	"net/http"

	"meshgpu/internal/source"
	"meshgpu/wire"
)

// Before authentication (docs/security.md, "Deadlines and limits before
// authentication"): a tunnel or /ws connection until its peer proved its
// key, and an /rpc request until its one message is read, cost the relay
// buffers for a sender it does not know. Their number is limited per source
// address and in all, and the hello they may send is hopmux.MaxTunnelHello
// bytes at most, so a flood of them cannot grow the relay.

// Defaults of Server.MaxUnauthenticatedPerSource and MaxUnauthenticated.
const (
	DefaultMaxUnauthenticatedPerSource = 16
	DefaultMaxUnauthenticated          = 1024
)

// enterUnauth counts one unauthenticated connection of r's source, or
// answers 429 (this source) or 503 (the relay) and reports false. The
// caller calls leave once the sender is authenticated (or its /rpc
// message read) or gone.
func (s *Server) enterUnauth(w http.ResponseWriter, r *http.Request) (leave func(), ok bool) {
	src := source.Key(r.RemoteAddr)
	s.mu.Lock()
	switch {
	case s.unauth[src] >= s.MaxUnauthenticatedPerSource:
		s.mu.Unlock()
		s.m.unauthRefused.WithLabelValues("source").Inc()
		w.Header().Set("Retry-After", "1")
		writeHTTPError(w, http.StatusTooManyRequests, wire.TypeRateLimited,
			fmt.Sprintf("more than %d connections from %s are not authenticated yet; finish a handshake first", s.MaxUnauthenticatedPerSource, src))
		return nil, false
	case s.unauthAll >= s.MaxUnauthenticated:
		s.mu.Unlock()
		s.m.unauthRefused.WithLabelValues("relay").Inc()
		w.Header().Set("Retry-After", "1")
		writeHTTPError(w, http.StatusServiceUnavailable, wire.TypeBusy,
			fmt.Sprintf("the relay has %d connections that are not authenticated yet; try later", s.MaxUnauthenticated))
		return nil, false
	}
	s.unauth[src]++
	s.unauthAll++
	s.mu.Unlock()
	done := false
	return func() {
		if done {
			return
		}
		done = true
		s.mu.Lock()
		if s.unauth[src]--; s.unauth[src] <= 0 {
			delete(s.unauth, src)
		}
		s.unauthAll--
		s.mu.Unlock()
	}, true
}
