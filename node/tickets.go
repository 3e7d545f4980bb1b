package node

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"meshgpu/identity"
	"meshgpu/ticket"
	"meshgpu/wire"
)

// Route tickets on the hop path (docs/security.md, "Route tickets"). A
// node with trusted issuers (its trackers' keys, or --trust-head peer ids)
// runs a hop only under a ticket that verifies, is for the hop's session,
// names this node at the hop's layers and names the route the binding
// carries; the session then belongs to the hop key the pass carried. A
// node with no trusted issuer (a one-machine mesh, the tests) takes
// unticketed hops only from loopback.

// headTicketTTL is how long a ticket the head signs for its static route is
// valid: the longest a generation of a static mesh may run, as its
// sessions die with the ticket (a tracker renews its shorter tickets).
const headTicketTTL = time.Hour

// ticketsRequired reports whether this node runs hops only under tickets.
func (s *Server) ticketsRequired() bool {
	return s.TicketIssuers != nil || len(s.TrustedHeads) > 0
}

// verifyTicket checks raw under this node's trust: a tracker key signs any
// session; a trusted head's key signs only the sessions it drives.
func (s *Server) verifyTicket(raw []byte) (*ticket.Ticket, error) {
	t, err := ticket.Parse(raw)
	if err != nil {
		return nil, err
	}
	tr := ticket.NewTrusted()
	tracker := false
	if s.TicketIssuers != nil {
		for _, k := range s.TicketIssuers() {
			if k.Equal(t.Issuer) {
				tracker = true
			}
			tr.Add(k)
		}
	}
	issuer := identity.PeerID(t.Issuer)
	if !tracker && slices.Contains(s.TrustedHeads, issuer) {
		if t.Head != issuer {
			return nil, fmt.Errorf("%w: head %s signed a ticket for a session head %q drives", ticket.ErrUntrustedIssuer, issuer, t.Head)
		}
		tr.Add(t.Issuer)
	}
	v, err := ticket.Verify(raw, tr, time.Now())
	if errors.Is(err, ticket.ErrUntrustedIssuer) && s.refreshIssuers() {
		return s.verifyTicket(raw)
	}
	return v, err
}

// refreshIssuers asks for the tracker list again, at most once a second
// (a flood of tickets from unknown issuers costs one request a second);
// it reports whether it asked.
func (s *Server) refreshIssuers() bool {
	if s.RefreshIssuers == nil {
		return false
	}
	s.refreshMu.Lock()
	defer s.refreshMu.Unlock()
	if time.Since(s.refreshed) < time.Second {
		return false
	}
	s.refreshed = time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	s.RefreshIssuers(ctx)
	return true
}

// hopOrigin is where a hop came from: the sender it arrived from over a
// hop connection or the relay tunnel (conn, wire.HopSender, compared by
// identity), or none (POST /forward), and the remote address when one is
// known.
type hopOrigin struct {
	conn   *wire.HopSender
	remote string
}

type hopOriginKey struct{}

func withHopOrigin(ctx context.Context, o hopOrigin) context.Context {
	return context.WithValue(ctx, hopOriginKey{}, o)
}

func originOf(ctx context.Context) hopOrigin {
	o, _ := ctx.Value(hopOriginKey{}).(hopOrigin)
	if hs := wire.HopSenderOf(ctx); hs != nil {
		o.conn = hs
		if o.remote == "" {
			o.remote = hs.Remote
		}
	}
	return o
}

// loopback reports whether the hop came straight from this machine.
func (o hopOrigin) loopback() bool {
	host, _, err := net.SplitHostPort(o.remote)
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// hopGrant is what a binding's pass gives one hop: the session's owner key
// (nil when unticketed), the peer that sends this hop (blamed for bad
// activations), and the pass for the next hop.
type hopGrant struct {
	key      []byte
	prev     string
	nextPass []byte
	// What the session remembers as verified (tickets required only): the
	// pass as received, the hop's layers and route, the ticket's expiry.
	pass       []byte
	start, end int
	route      []wire.Hop
	expiry     time.Time
	// replyTo is where this hop, the route's last, sends direct replies
	// (the ticket's head address); nil: chain answers only.
	replyTo *replyTarget
}

// reuseVerified returns the grant of a pass this session already verified
// and claimed, byte for byte the same and not expired: a session bound
// again (a failover, a sender the tail forgot) need not verify it again.
func (s *Server) reuseVerified(req *hopRequest) *hopGrant {
	sess := s.sessions.lookup(req.session)
	if sess == nil {
		return nil
	}
	v := sess.verified.Load()
	if v == nil || len(v.pass) != len(req.ticket) || subtle.ConstantTimeCompare(v.pass, req.ticket) != 1 ||
		v.start != req.start || v.end != req.end || !slices.Equal(v.route, req.route) || time.Now().After(v.expiry.Add(ticket.DefaultMaxSkew)) {
		return nil
	}
	g := *v
	req.ticket = g.nextPass
	return &g
}

func forbidden(typ, format string, args ...any) *apiError {
	return &apiError{Status: http.StatusForbidden, Type: typ, Message: fmt.Sprintf(format, args...)}
}

// authorizeBinding checks the binding req brought against this node's
// trust, before any session is created. On success req.route is the route
// the ticket names after this hop and req.ticket the pass for its next hop.
func (s *Server) authorizeBinding(req *hopRequest, o hopOrigin) (*hopGrant, *apiError) {
	if !s.ticketsRequired() {
		if !o.loopback() {
			return nil, forbidden("ticket_required",
				"this node trusts no ticket issuer (no --tracker, no --trust-head), so it runs hops only from loopback; got one from %q", o.remote)
		}
		// The pass goes on unverified, with this hop's key taken off, for
		// nodes further on that check it.
		if pass, err := ticket.ParsePass(req.ticket); err == nil {
			if t, err := ticket.Parse(pass.Ticket); err == nil {
				if i, err := t.Index(s.PeerID, req.start); err == nil && len(pass.Keys) == len(t.Hops)-i {
					req.ticket, _ = pass.Rest().Encode()
				}
			}
		}
		return &hopGrant{prev: o.remote}, nil
	}
	if len(req.ticket) == 0 {
		return nil, forbidden("ticket_required", "session %s: this node runs hops only under a route ticket", req.session)
	}
	if g := s.reuseVerified(req); g != nil {
		return g, nil
	}
	received := bytes.Clone(req.ticket)
	pass, err := ticket.ParsePass(req.ticket)
	if err != nil {
		return nil, forbidden("invalid_ticket", "%v", err)
	}
	t, err := s.verifyTicket(pass.Ticket)
	if errors.Is(err, ticket.ErrExpired) {
		return nil, forbidden(wire.TypeTicketExpired, "%v", err)
	}
	if err != nil {
		return nil, forbidden("invalid_ticket", "%v", err)
	}
	if !t.Covers(req.session) {
		if err := t.CheckSession(req.session); err != nil && !strings.HasPrefix(req.session, t.SessionID+":") {
			return nil, forbidden("invalid_ticket", "%v", err)
		}
		return nil, forbidden("invalid_ticket", "session %q is not one of the %d sessions ticket %q opens", wire.Truncate(req.session, 80), t.Choices, t.SessionID)
	}
	i, err := t.Index(s.PeerID, req.start)
	if err != nil {
		return nil, forbidden("invalid_ticket", "%v", err)
	}
	if t.Hops[i].Last != req.end {
		return nil, forbidden("invalid_ticket", "the ticket gives this node layers %d-%d, the hop asks for %d-%d", t.Hops[i].First, t.Hops[i].Last, req.start, req.end)
	}
	route := ticketRoute(t.Hops[i+1:])
	if !slices.Equal(route, req.route) {
		return nil, forbidden("invalid_ticket", "the binding's route is not the one the ticket names after this hop")
	}
	if len(pass.Keys) != len(t.Hops)-i {
		return nil, forbidden("invalid_ticket", "the pass has %d session keys for the %d hops from this one", len(pass.Keys), len(t.Hops)-i)
	}
	next, err := pass.Rest().Encode()
	if err != nil {
		return nil, forbidden("invalid_ticket", "%v", err)
	}
	prev := t.Head
	if i > 0 {
		prev = t.Hops[i-1].PeerID
	}
	req.route = route
	if len(route) == 0 {
		next = nil
	}
	req.ticket = next
	return &hopGrant{key: pass.Keys[0], prev: prev, nextPass: next,
		pass: received, start: req.start, end: req.end, route: route, expiry: t.Expiry, replyTo: replyTargetOf(t, len(route) == 0)}, nil
}

// ticketRoute is ticket hops as a binding's route.
func ticketRoute(hops []ticket.Hop) []wire.Hop {
	if len(hops) == 0 {
		return nil
	}
	r := make([]wire.Hop, len(hops))
	for i, h := range hops {
		r[i] = wire.Hop{Endpoint: h.Endpoint, StartLayer: h.First, EndLayer: h.Last, RelayAddr: h.RelayAddr, PeerID: h.PeerID}
	}
	return r
}

// claim makes g's holder the session's owner, or checks that it is: a
// session belongs to the key that created it; the head's own sessions to
// nobody on the network. Called under the session's lock.
func (s *Server) claim(sess *session, g *hopGrant, o hopOrigin) *apiError {
	owner := sess.key.Load()
	switch {
	case sess.local.Load():
		return forbidden("session_owned", "session %s is driven by this node", sess.id)
	case owner == nil && g.key == nil:
		if sess.binding != nil && s.ticketsRequired() {
			return forbidden("session_owned", "session %s has an owner", sess.id)
		}
	case owner == nil:
		if sess.binding != nil || sess.kv.Len() > 0 {
			return forbidden("session_owned", "session %s was not created under a ticket", sess.id)
		}
		k := bytes.Clone(g.key)
		sess.key.Store(&k)
	case g.key == nil || subtle.ConstantTimeCompare(*owner, g.key) != 1:
		return forbidden("session_owned", "session %s belongs to another session key", sess.id)
	}
	sess.conn, sess.prev = o.conn, g.prev
	if g.pass != nil {
		sess.verified.Store(g)
	}
	return nil
}

// ticketLive refuses a hop on a session whose ticket has expired (past
// the skew): a session dies with its ticket. The caller holds the session's
// lock and drops the session. A generation that runs longer than its
// ticket is resumed by its issuer on a new ticket (the tracker's renewal,
// tracker/proxy.go).
func ticketLive(sess *session, now time.Time) *apiError {
	if sess.ticketExpired(now) {
		return forbidden(wire.TypeTicketExpired, "session %s: its route ticket expired at %s", sess.id, sess.verified.Load().expiry.UTC().Format(time.RFC3339))
	}
	return nil
}

// checkUnbound lets an unbound hop run on an owned session only from the
// sender that bound it (the same hop connection, or the same peer through
// the same relay tunnel); any other sender must bind (and so show the key)
// first.
func checkUnbound(sess *session, o hopOrigin) *apiError {
	if sess.local.Load() {
		return forbidden("session_owned", "session %s is driven by this node", sess.id)
	}
	if sess.key.Load() != nil && (o.conn == nil || o.conn != sess.conn) {
		return errUnbound(sess.id)
	}
	return nil
}

// authorizeDelete lets DELETE /sessions/{id} free a session only with the
// session's key or its ticket issuer's release (a ticketed session), or,
// for an unticketed one, from loopback on a node that trusts no issuer.
// The release is how the tracker frees a failed route's sessions: it signs
// the tickets but never holds the keys the head makes; the route's nodes
// hold the ticket but cannot sign a release.
func (s *Server) authorizeDelete(r *http.Request, id string) *apiError {
	sess := s.sessions.lookup(id)
	if sess == nil {
		return nil // remove answers 404
	}
	if sess.local.Load() {
		return forbidden("session_owned", "session %s is driven by this node", id)
	}
	if v := r.Header.Get(wire.HeaderSessionRelease); v != "" && sess.key.Load() != nil {
		if released(sess, id, v) {
			return nil
		}
		return forbidden("session_owned", "DELETE /sessions/%s: %s is not the release of the session's ticket issuer", id, wire.HeaderSessionRelease)
	}
	key, err := base64.RawURLEncoding.DecodeString(r.Header.Get(wire.HeaderSessionKey))
	switch owner := sess.key.Load(); {
	case owner != nil:
		if err != nil || subtle.ConstantTimeCompare(*owner, key) != 1 {
			return forbidden("session_owned", "DELETE /sessions/%s needs the session's key in %s or its ticket issuer's release in %s", id, wire.HeaderSessionKey, wire.HeaderSessionRelease)
		}
	case s.ticketsRequired() || !(hopOrigin{remote: r.RemoteAddr}).loopback():
		return forbidden("session_owned", "session %s can be freed only by its owner", id)
	}
	return nil
}

// released reports whether v (base64url) is the release of session id
// signed by the issuer of the ticket sess was claimed under.
func released(sess *session, id, v string) bool {
	g := sess.verified.Load()
	if g == nil {
		return false
	}
	sig, err := base64.RawURLEncoding.DecodeString(v)
	if err != nil {
		return false
	}
	pass, err := ticket.ParsePass(g.pass)
	if err != nil {
		return false
	}
	return ticket.VerifyRelease(id, pass.Ticket, sig)
}

// sessionGrant is what the head drives one request under: the session id
// (the ticket's, never the completion id), the ticket and one session key
// per route hop. A nil ticket: unticketed hops (a node trusting no issuer).
type sessionGrant struct {
	id     string
	ticket []byte
	keys   [][]byte
	pass   []byte // Pass{ticket, keys}, what the first hop's binding carries
	// static: the operator's route (--route, --peer), not a tracker's. No
	// tracker routes around a busy node then, so the head waits for it.
	static bool
}

// sessionID is the session of choice index of n.
func (g *sessionGrant) sessionID(index, n int) string {
	if n > 1 {
		return g.id + ":" + strconv.Itoa(index)
	}
	return g.id
}

func newSessionID() string {
	var b [16]byte
	rand.Read(b[:])
	return "s-" + base64.RawURLEncoding.EncodeToString(b[:])
}

func (s *Server) newGrant(id string, raw []byte, n int) (*sessionGrant, *apiError) {
	g := &sessionGrant{id: id, ticket: raw}
	if raw == nil {
		return g, nil
	}
	keys, err := ticket.NewKeys(n)
	if err != nil {
		return nil, asAPIError(err)
	}
	g.keys = keys
	if g.pass, err = (ticket.Pass{Ticket: raw, Keys: keys}).Encode(); err != nil {
		return nil, asAPIError(err)
	}
	return g, nil
}

// planSession picks a request's route and its ticket. X-Meshnet-Route is
// taken only with a ticket for it from an issuer this node trusts (the
// tracker's proxy); a client cannot name an address this node contacts.
// Otherwise the route is the operator's (--route, --peer) and the head
// signs its ticket with its own key.
func (s *Server) planSession(ctx context.Context, h http.Header, choices int) (int, []wire.Hop, *sessionGrant, *apiError) {
	if v := h.Get(wire.HeaderTicket); v != "" {
		return s.planTicketed(v, h, choices)
	}
	if v := strings.TrimSpace(h.Get(wire.HeaderRoute)); v != "" && v != "[]" {
		return 0, nil, nil, headerError(wire.HeaderRoute, "a route is chosen by this node's operator or its tracker; a request cannot name one without a route ticket (%s)", wire.HeaderTicket)
	}
	headEnd, route, ae := s.planRoute(ctx, h)
	if ae != nil {
		return 0, nil, nil, ae
	}
	id := newSessionID()
	if len(route) == 0 || s.Identity == nil || s.PeerID == "" || slices.ContainsFunc(route, func(h wire.Hop) bool { return h.PeerID == "" }) {
		if len(route) > 0 {
			s.Logger.Debug("route without peer ids: hops go unticketed (only nodes that trust no issuer take them)")
		}
		g, ae := s.newGrant(id, nil, 0)
		if g != nil {
			g.static = true
		}
		return headEnd, route, g, ae
	}
	now := time.Now()
	t := ticket.Ticket{SessionID: id, Head: s.PeerID, IssuedAt: now, Expiry: now.Add(headTicketTTL), Choices: choices}
	if !s.NoDirectReplies {
		t.HeadEndpoint, t.HeadRelay = s.ReplyEndpoint, s.ReplyRelay
	}
	for _, h := range route {
		t.Hops = append(t.Hops, ticket.Hop{PeerID: h.PeerID, Endpoint: h.Endpoint, RelayAddr: h.RelayAddr, First: h.StartLayer, Last: h.EndLayer})
	}
	raw, err := ticket.Sign(t, s.Identity.Private)
	if err != nil {
		return 0, nil, nil, &apiError{Status: http.StatusServiceUnavailable, Type: "no_route", Message: "signing the route ticket: " + err.Error()}
	}
	g, ae := s.newGrant(id, raw, len(route))
	if g != nil {
		g.static = true
	}
	return headEnd, route, g, ae
}

// planTicketed takes the route a trusted issuer's ticket names for this head.
func (s *Server) planTicketed(v string, h http.Header, choices int) (int, []wire.Hop, *sessionGrant, *apiError) {
	bad := func(format string, args ...any) (int, []wire.Hop, *sessionGrant, *apiError) {
		return 0, nil, nil, forbidden("invalid_ticket", wire.HeaderTicket+": "+format, args...)
	}
	raw, err := ticket.FromString(v)
	if err != nil {
		return bad("%v", err)
	}
	t, err := s.verifyTicket(raw)
	if err != nil {
		return bad("%v", err)
	}
	if err := t.CheckHead(s.PeerID); err != nil {
		return bad("%v", err)
	}
	if !wire.ValidSessionID(t.SessionID) || len(t.SessionID) > wire.MaxSessionIDLen-8 {
		return bad("session id %q is not usable", wire.Truncate(t.SessionID, 40))
	}
	if t.Choices != choices {
		// The hops would refuse every session but the ticket's own.
		return 0, nil, nil, badRequest("the route ticket opens %d sessions; this request has %d choices", t.Choices, choices)
	}
	route := ticketRoute(t.Hops)
	if len(route) == 0 {
		return bad("the ticket names no hop after the head")
	}
	if err := wire.CheckRoute(route, s.cfg.NumLayers); err != nil {
		return bad("%v", err)
	}
	if rv := h.Get(wire.HeaderRoute); rv != "" {
		r, err := wire.ParseRoute(rv, s.cfg.NumLayers)
		if err != nil || !slices.Equal(r, route) {
			return 0, nil, nil, headerError(wire.HeaderRoute, "differs from the route the ticket names")
		}
	}
	headEnd := route[0].StartLayer - 1
	if headEnd < s.cfg.First || headEnd > s.cfg.Last {
		return bad("the ticket's first hop starts at layer %d; this head serves %d-%d", route[0].StartLayer, s.cfg.First, s.cfg.Last)
	}
	if err := checkCoverage(headEnd, route, s.cfg.NumLayers); err != nil {
		return bad("%v", err)
	}
	g, ae := s.newGrant(t.SessionID, raw, len(route))
	return headEnd, route, g, ae
}

// maxActivation bounds the magnitude of a hop's activations (the residual
// stream between layers). Trained models stay far below it: their largest
// ("massive") activations are in the thousands, and fp16-trained ones
// below 65504. Up to it the receiving node's arithmetic stays finite: an
// RMSNorm's f32 sum of squares over MaxHidden values is at most
// 2^20 * 2^40 = 2^60, far from float32's 2^128. Beyond it a sender can
// pass the finite check with values (f32 3e38, bf16 max) that overflow the
// norm and make the logits uniform: token 0 with no error.
const maxActivation = 1 << 20

// inRange reports whether every value of activations b (bf16 or f32) has a
// magnitude below maxActivation; NaN and Inf (an exponent of all ones) are
// above it. It tests a word of values at a time (every hop checks its
// payload): a value's magnitude bits plus (top bit - the bound's bits)
// carry into the value's top bit only when the magnitude is at least the
// bound, and never into the next value.
func inRange(b []byte, bf16 bool) bool {
	// bf16 2^20: exponent 127+20 at bit 7 (0x4980); f32: at bit 23.
	abs, add, top, size := uint64(0x7fff7fff7fff7fff), uint64(0x3680368036803680), uint64(0x8000800080008000), 2
	if !bf16 {
		abs, add, top, size = 0x7fffffff7fffffff, 0x3680000036800000, 0x8000000080000000, 4
	}
	i := 0
	for ; i+8 <= len(b); i += 8 {
		if (binary.LittleEndian.Uint64(b[i:])&abs+add)&top != 0 {
			return false
		}
	}
	for ; i+size <= len(b); i += size {
		var v uint64
		if bf16 {
			v = uint64(binary.LittleEndian.Uint16(b[i:]))
		} else {
			v = uint64(binary.LittleEndian.Uint32(b[i:]))
		}
		if (v&abs+add)&top != 0 {
			return false
		}
	}
	return true
}

// hasNonFinite reports whether activations b hold NaN or Inf (an exponent
// of all ones); read only for the message once inRange failed.
func hasNonFinite(b []byte, bf16 bool) bool {
	if bf16 {
		for i := 0; i+2 <= len(b); i += 2 {
			if binary.LittleEndian.Uint16(b[i:])&0x7f80 == 0x7f80 {
				return true
			}
		}
		return false
	}
	for i := 0; i+4 <= len(b); i += 4 {
		if binary.LittleEndian.Uint32(b[i:])&0x7f800000 == 0x7f800000 {
			return true
		}
	}
	return false
}

// finiteLogits reports whether no logit is NaN (-Inf is a masked token,
// +Inf is refused too: it would win every draw).
func finiteLogits(l []float32) bool {
	for _, v := range l {
		if v != v || v > math.MaxFloat32 {
			return false
		}
	}
	return true
}

// sessionKeyHeader is a hop's session key as DELETE presents it.
func sessionKeyHeader(k []byte) string { return base64.RawURLEncoding.EncodeToString(k) }
