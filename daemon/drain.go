package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"

	"meshgpu/wire"
)

// Drain takes the node out of the mesh before Close (SIGTERM): it stops
// heartbeats, deregisters (the tracker routes no new request here from
// now on), refuses new OpenAI requests, and waits until the sessions it
// holds and the work in flight are done, grace has passed, or ctx ends.
// It reports whether the node drained (grace 0: deregister only); Close
// must still be called.
//
// Streams that run through the node keep their hops meanwhile; one still
// running when the grace ends breaks at Close and the tracker replays it
// on another route (docs/tracker.md, "Chat proxy").
func (n *Node) Drain(ctx context.Context, grace time.Duration) bool {
	if !n.draining.CompareAndSwap(false, true) {
		return false
	}
	deadline := time.Now().Add(grace)
	if n.trackc != nil {
		// No heartbeat or registration may reach the tracker after the
		// goodbye: stop the announcer and wait until it has returned (the
		// tracker also refuses messages signed before a goodbye).
		n.stopAnn()
		select {
		case <-n.annDone:
		case <-ctx.Done():
		case <-time.After(5 * time.Second):
			n.log.Warn("the tracker announcer did not stop within 5s; deregistering anyway")
		}
		dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		if err := n.trackc.Deregister(dctx); err != nil {
			n.log.Warn("deregistering from the tracker failed; it forgets this node at its heartbeat timeout", "tracker", n.trackc.Current(), "err", err)
		} else {
			n.log.Info("deregistered from the tracker", "tracker", n.trackc.Current())
		}
		cancel()
	}
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	logged := false
	for {
		st := n.Stats()
		busy := st.Sessions + st.Running + st.Queued + st.HopsInFlight
		if busy == 0 {
			if logged {
				n.log.Info("drained: every session finished")
			}
			return true
		}
		if !logged {
			n.log.Info("draining: waiting for sessions to finish", "sessions", st.Sessions, "running", st.Running,
				"queued", st.Queued, "hops_in_flight", st.HopsInFlight, "grace", grace)
			logged = true
		}
		if time.Now().After(deadline) {
			n.log.Warn("drain grace period over; stopping with sessions left (the tracker replays their streams elsewhere)",
				"sessions", st.Sessions, "running", st.Running)
			return false
		}
		select {
		case <-ctx.Done():
			n.log.Warn("drain interrupted; stopping now", "sessions", st.Sessions)
			return false
		case <-t.C:
		}
	}
}

// Draining reports whether Drain has begun.
func (n *Node) Draining() bool { return n.draining.Load() }

// serveLifecycle answers what the node as a whole decides rather than its
// shard: /ready of a draining or tracker-joined node, and the refusal of
// new OpenAI requests while draining. It reports whether it answered.
func (n *Node) serveLifecycle(w http.ResponseWriter, r *http.Request) bool {
	switch {
	case r.URL.Path == "/ready" && r.Method == http.MethodGet:
		if n.draining.Load() {
			writeNotReady(w, "shutting_down", "the node is draining before it stops")
			return true
		}
		if n.announcer == nil {
			return false // a static node: its shard knows its route
		}
		st := n.announcer.State()
		switch {
		case !st.Registered && st.Err != nil:
			writeNotReady(w, "not_ready", "not registered with the tracker "+n.trackc.Current()+": "+st.Err.Error())
		case !st.Registered:
			writeNotReady(w, "not_ready", "not registered with the tracker "+n.trackc.Current()+" yet")
		case n.announcer.Stale():
			writeNotReady(w, "not_ready", fmt.Sprintf("the tracker %s has not answered since %s: %v", n.trackc.Current(), st.LastOK.UTC().Format(time.RFC3339), st.Err))
		case st.Routable != nil && !*st.Routable:
			writeNotReady(w, "not_ready", "registered with the tracker "+n.trackc.Current()+", which does not route through this node yet: "+st.NotRoutable)
		default:
			first, last := n.Layers()
			w.Header().Set("Content-Type", "application/json")
			json.NewEncoder(w).Encode(map[string]any{"status": "ready", "model": n.name, "layers": [2]int{first, last},
				"tracker": n.trackc.Current(), "registered": true, "routable": st.Routable == nil || *st.Routable})
		}
		return true
	case n.trackerRouted() && r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/v1/") && r.Header.Get(wire.HeaderTicket) == "":
		// Without the tracker's ticket this head has no route of its own;
		// say where the requests go instead of "start with --peer".
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		json.NewEncoder(w).Encode(map[string]any{"error": map[string]string{"type": "no_route",
			"message": "this head is routed by its tracker and has no route of its own: send chats to the tracker, " + n.trackc.Current() + r.URL.Path}})
		return true
	case n.draining.Load() && r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/v1/"):
		// A new generation would hold the node past its grace period.
		w.Header().Set("Retry-After", "1")
		writeNotReady(w, "shutting_down", "the node is shutting down; send the request to the tracker or another head")
		return true
	}
	return false
}

// trackerRouted: a tracker-joined node that needs a route for a request
// (it holds layer 0 but not every layer) and has no static one.
func (n *Node) trackerRouted() bool {
	first, last := n.Layers()
	return n.trackc != nil && first == 0 && last < n.mcfg.NumLayers-1 && len(n.cfg.Route) == 0 && len(n.cfg.Peers) == 0
}

func writeNotReady(w http.ResponseWriter, typ, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusServiceUnavailable)
	json.NewEncoder(w).Encode(map[string]any{"error": map[string]string{"message": msg, "type": typ}})
}
