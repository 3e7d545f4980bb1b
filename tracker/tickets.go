package tracker

import (
	"crypto/ed25519"
	"errors"
	"time"

	"meshgpu/ticket"
	"meshgpu/tracker/route"
)

// DefaultTicketTTL is how long a route ticket the tracker issues is valid:
// a generation's lifetime, renewed on failover (a new route, a new ticket).
const DefaultTicketTTL = 10 * time.Minute

// IssueTicket signs rt as the route ticket of session sessionID: its first
// hop is the head that may drive the session, the others are the hops the
// ticket names. The hop path (issue 12's per-session binding) carries it.
func IssueTicket(key ed25519.PrivateKey, rt route.Route, sessionID string, now time.Time, ttl time.Duration) ([]byte, error) {
	if len(rt.Hops) < 2 {
		return nil, errors.New("tracker: a route ticket needs a head and at least one hop after it")
	}
	if ttl <= 0 {
		ttl = DefaultTicketTTL
	}
	t := ticket.Ticket{SessionID: sessionID, Head: rt.Hops[0].PeerID, IssuedAt: now, Expiry: now.Add(ttl)}
	for _, h := range rt.Hops[1:] {
		t.Hops = append(t.Hops, ticket.Hop{PeerID: h.PeerID, Endpoint: h.Endpoint, RelayAddr: h.RelayAddr, First: h.StartLayer, Last: h.EndLayer})
	}
	return ticket.Sign(t, key)
}
