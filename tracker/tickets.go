package tracker

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"meshgpu/ticket"
	"meshgpu/tracker/route"
	"meshgpu/wire"
)

// DefaultTicketTTL is how long a route ticket the tracker issues is valid:
// a generation's lifetime, renewed on failover (a new route, a new ticket).
const DefaultTicketTTL = 10 * time.Minute

// IssueTicket signs rt as the route ticket of session sessionID: its first
// hop is the head that may drive the session, the others are the hops the
// ticket names. The hop path (issue 12's per-session binding) carries it.
// With rt.DirectReplies the ticket (version 3) also names the head hop's
// endpoint and relay as where the tail sends its replies: the addresses
// the head registered, signed, and the tracker reaches it at, never one
// a request names. A head address the ticket encoding cannot hold (longer
// than ticket.MaxAddr) leaves the ticket without it: chain replies only.
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
	if rt.DirectReplies {
		direct := t
		direct.HeadEndpoint, direct.HeadRelay = rt.Hops[0].Endpoint, rt.Hops[0].RelayAddr
		if raw, err := ticket.Sign(direct, key); err == nil {
			return raw, nil
		}
	}
	return ticket.Sign(t, key)
}

// ticketKey is the tracker's ticket key: key, or one made now. Self
// publishes its public half (unless Self already names a key, which must
// be key's: nodes trust what Self says).
func ticketKey(key ed25519.PrivateKey, self TrackerInfo, log *slog.Logger) (ed25519.PrivateKey, TrackerInfo) {
	if len(key) != ed25519.PrivateKeySize {
		_, k, err := ed25519.GenerateKey(rand.Reader)
		if err != nil {
			panic("tracker: no randomness for a ticket key: " + err.Error())
		}
		key = k
	}
	pub := hex.EncodeToString(key.Public().(ed25519.PublicKey))
	switch self.PublicKey {
	case "":
		self.PublicKey = pub
	case pub:
	default:
		log.Error("tracker: Self.PublicKey is not the ticket key's; nodes will refuse this tracker's tickets")
	}
	return key, self
}

// setTicket signs rt as a new session's route ticket and sets it on the
// request to the head, which drives the session under it: the head takes
// X-Meshnet-Route only with a ticket from a tracker it trusts. It returns
// the ticket's session id and the ticket as sent ("" when rt has no hop
// after the head): the nodes' session, which freeSessions deletes with it.
func (s *Server) setTicket(h http.Header, rt route.Route) (session, tk string, err error) {
	if len(rt.Hops) < 2 {
		return "", "", nil // the head runs every layer: no hop, no ticket
	}
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", "", err
	}
	id := "t-" + base64.RawURLEncoding.EncodeToString(b[:])
	raw, err := IssueTicket(s.cfg.TicketKey, rt, id, s.cfg.Clock(), s.cfg.TicketTTL)
	if err != nil {
		return "", "", err
	}
	tk = ticket.String(raw)
	h.Set(wire.HeaderTicket, tk)
	return id, tk, nil
}

// registerAnswer is POST /register's answer: the stored record and the
// mesh's trackers, so a node knows their ticket keys before any route
// names it (heartbeat answers keep the list fresh).
type registerAnswer struct {
	NodeRecord
	Trackers []TrackerInfo `json:"trackers,omitempty"`
	// Routable and NotRoutable: as in HeartbeatResponse.
	Routable    *bool  `json:"routable,omitempty"`
	NotRoutable string `json:"not_routable,omitempty"`
}

func (s *Server) register(ctx context.Context, b []byte) (any, error) {
	rec, err := s.reg.Register(ctx, b)
	if err != nil {
		return nil, err
	}
	trackers, err := s.meshTrackers(ctx)
	if err != nil {
		return nil, err
	}
	ok, why, err := s.reg.Routable(ctx, rec.PeerID)
	if err != nil {
		return nil, err
	}
	return registerAnswer{NodeRecord: rec, Trackers: trackers, Routable: &ok, NotRoutable: why}, nil
}

// RefreshTrackers asks each configured tracker (URL and Fallbacks, the
// node's --tracker list) for the mesh's trackers (GET /trackers), the list
// a heartbeat answer would bring: a node that meets a ticket from a
// tracker it has not heard of yet (one restarted with a new key) asks
// before refusing it. A tracker always lists itself.
func (c *Client) RefreshTrackers(ctx context.Context) error {
	var all []TrackerInfo
	seen := map[string]bool{}
	var firstErr error
	for _, base := range append([]string{c.URL}, c.Fallbacks...) {
		ts, err := c.fetchTrackers(ctx, strings.TrimSuffix(base, "/"))
		if err != nil {
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		for _, t := range ts {
			if !seen[t.PublicKey] {
				seen[t.PublicKey] = true
				all = append(all, t)
			}
		}
	}
	if len(all) == 0 {
		return firstErr
	}
	c.learn(all)
	return nil
}

func (c *Client) fetchTrackers(ctx context.Context, base string) ([]TrackerInfo, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/trackers", nil)
	if err != nil {
		return nil, err
	}
	hc := c.HTTP
	if hc == nil {
		hc = &http.Client{Timeout: 10 * time.Second}
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("tracker /trackers: %w", err)
	}
	defer resp.Body.Close()
	var out struct {
		Trackers []TrackerInfo `json:"trackers"`
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("tracker /trackers: HTTP %d", resp.StatusCode)
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&out); err != nil {
		return nil, fmt.Errorf("tracker /trackers: %w", err)
	}
	return out.Trackers, nil
}

// meshTrackers is the store's tracker list with this tracker in it, even
// before its own publication reaches the store: its ticket key is good
// from its first request.
func (s *Server) meshTrackers(ctx context.Context) ([]TrackerInfo, error) {
	ts, err := s.reg.store.Trackers(ctx)
	if err != nil || s.cfg.Self.PeerID == "" {
		return ts, err // a tracker without a Self publishes nothing of its own
	}
	for _, t := range ts {
		if t.PublicKey == s.cfg.Self.PublicKey {
			return ts, nil
		}
	}
	return append(ts, s.cfg.Self), nil
}
