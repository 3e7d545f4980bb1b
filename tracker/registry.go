package tracker

import (
	"cmp"
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"math"
	"net/url"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"meshgpu/tracker/route"
	"meshgpu/wire"
)

// apiError is an error with its HTTP status and OpenAI-style type.
type apiError = wire.Error

func errf(status int, typ, format string, args ...any) *apiError {
	return &apiError{Status: status, Type: typ, Message: fmt.Sprintf(format, args...)}
}

// MaxLayers bounds a model's layer count (real models have at most a few
// hundred), which bounds the cost of routing and assignment.
const MaxLayers = 1024

var modelName = regexp.MustCompile(`^[A-Za-z0-9._:/@+-]{1,128}$`)

// Registry is the tracker's state and rules: who is registered, who has
// expired, who is banned, which layers are reserved by pending assignments.
type Registry struct {
	store   Store
	clock   func() time.Time
	timeout time.Duration // heartbeat timeout
	maxSkew time.Duration
	cfg     route.Config
	// moveWait is how long a move order stays pending (no other move is
	// ordered for the model meanwhile).
	moveWait time.Duration

	// joinToken, when set, must be presented by registrations and
	// assignment requests.
	joinToken string

	// mu serializes this tracker's check-then-write on the store; other
	// trackers on a shared store are kept out by its conditional writes.
	mu sync.Mutex
	// inflight counts the proxied generations using each node now; each
	// adds inflightRPM to the node's reported RPM when routing, so
	// concurrent streams spread before heartbeats report the load.
	inflight    map[string]int
	inflightRPM float64
	// speeds is the tracker's measure of each node's pace (measure.go).
	speeds map[string]*measured
	routed uint64 // routes computed (measure.go's exploration share)

	// tombs holds, per deregistered peer, its goodbye's timestamp for the
	// clock skew a message signed before it may still arrive within:
	// registrations and heartbeats signed at or before it are refused, so
	// one sent before the goodbye and arriving after it does not bring the
	// node back (guarded by mu; at most maxTombstones).
	tombs map[string]tombstone

	// Admission of registrants (SetAdmission): the addresses they may
	// name, the per-key rate limit and the identity challenge (nil: none).
	policy    AddrPolicy
	keyLimit  *limiter
	challenge *challenger

	// limits bound how many nodes, models and layers registrations add.
	limits Limits

	// probation keeps new nodes out of routes until audited, trusted
	// are the operator's trusted peers (AuditConfig; tracker/audit.go).
	probation bool
	trusted   map[string]bool
}

// SetAdmission sets the address policy, the per-peer-id registration
// limit and the challenger (nil: registrations are not proved).
func (g *Registry) SetAdmission(policy AddrPolicy, keyLimit *limiter, c *challenger) {
	g.policy, g.keyLimit, g.challenge = policy, keyLimit, c
}

// SetLimits sets the registration caps (zero fields: defaults).
func (g *Registry) SetLimits(l Limits) { g.limits = l }

// NewRegistry returns a registry over store (nil: a MemStore).
func NewRegistry(store Store, clock func() time.Time, heartbeatTimeout, maxSkew time.Duration, cfg route.Config) *Registry {
	if store == nil {
		store = &MemStore{}
	}
	if clock == nil {
		clock = time.Now
	}
	if heartbeatTimeout <= 0 {
		heartbeatTimeout = DefaultHeartbeatTimeout
	}
	if maxSkew <= 0 {
		maxSkew = DefaultMaxClockSkew
	}
	return &Registry{
		store: store, clock: clock, timeout: heartbeatTimeout, maxSkew: maxSkew, cfg: cfg,
		moveWait: 4 * heartbeatTimeout,
		inflight: map[string]int{}, inflightRPM: 600,
	}
}

// SetJoinToken makes registration and assignment require token ("" turns
// the check off).
func (g *Registry) SetJoinToken(token string) { g.joinToken = token }

func (g *Registry) checkJoinToken(got string) error {
	if g.joinToken != "" && subtle.ConstantTimeCompare([]byte(got), []byte(g.joinToken)) != 1 {
		return errf(403, "permission_error", "join_token is missing or wrong")
	}
	return nil
}

func firstNonEmpty(s ...string) string {
	for _, v := range s {
		if v != "" {
			return v
		}
	}
	return ""
}

func checkURL(field, raw string, schemes ...string) error {
	if len(raw) > 2048 {
		return fmt.Errorf("%s is longer than 2048 bytes", field)
	}
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return fmt.Errorf("%s %q is not an absolute URL", field, raw)
	}
	for _, s := range schemes {
		if u.Scheme == s {
			return nil
		}
	}
	return fmt.Errorf("%s %q must use scheme %v", field, raw, schemes)
}

// validate checks a registration's content (not its signature).
func (reg *Registration) validate() error {
	if !modelName.MatchString(reg.Model) {
		return errors.New("model must be 1-128 characters of [A-Za-z0-9._:/@+-]")
	}
	if reg.NumLayers <= 0 || reg.NumLayers > MaxLayers {
		return fmt.Errorf("num_layers %d is out of range 1-%d", reg.NumLayers, MaxLayers)
	}
	n := route.Node{First: reg.Layers[0], Last: reg.Layers[1]}
	if err := n.Validate(reg.NumLayers); err != nil {
		return err
	}
	if reg.Endpoint == "" && reg.RelayAddr == "" {
		return errors.New("give an endpoint, a relay_addr, or both")
	}
	if reg.Endpoint != "" {
		if err := checkURL("endpoint", reg.Endpoint, "http", "https"); err != nil {
			return err
		}
	}
	if reg.RelayAddr != "" {
		if err := checkURL("relay_addr", reg.RelayAddr, "ws", "wss"); err != nil {
			return err
		}
	}
	if err := errors.Join(
		checkFigure("ms_per_layer", reg.MsPerLayer, maxMsLayer),
		checkFigure("memory_budget", float64(reg.MemoryBudget), maxFreeMemB),
		checkFigure("free_memory", float64(reg.FreeMemory), maxFreeMemB),
		checkFigure("bytes_per_layer", float64(reg.BytesPerLayer), maxFreeMemB),
		checkFigure("kv_reserve_per_layer", float64(reg.KVReservePerLayer), maxFreeMemB),
		checkFigure("embed_bytes", float64(reg.EmbedBytes), maxFreeMemB),
		checkFigure("head_bytes", float64(reg.HeadBytes), maxFreeMemB)); err != nil {
		return err
	}
	if len(reg.Backend) > 64 {
		return errors.New("backend name is longer than 64 bytes")
	}
	if reg.TicketVersion < 0 || reg.TicketVersion > 255 {
		return fmt.Errorf("ticket_version %d is out of range 0-255", reg.TicketVersion)
	}
	if err := reg.Variant.Validate(); err != nil {
		return err
	}
	return checkLayerBytes(reg.LayerBytes, reg.NumLayers)
}

// Bounds of a node's reported figures. Beyond them a figure is a bug or a
// lie: it is refused (400, the node's log says which) rather than clamped,
// so its operator sees it, and routing never computes with an RPM of 1e308
// (an infinite cost) or shows it on the page.
const (
	maxRate     = 1e9     // rpm1, rpm5, tokens_per_sec
	maxMs       = 1e7     // hop latencies (about 3 hours)
	maxCount    = 1 << 20 // sessions, running, queued, hops in flight
	maxMsLayer  = 1e6     // ms_per_layer
	maxFreeMemB = route.MaxFootprintBytes
)

// checkFigure says what is wrong with v as a figure in [0, most].
func checkFigure(name string, v, most float64) error {
	if math.IsNaN(v) || v < 0 || v > most {
		return fmt.Errorf("%s %v is out of range 0-%g", name, v, most)
	}
	return nil
}

func (hb *Heartbeat) validate() error {
	st := &hb.Stats
	return errors.Join(
		checkFigure("free_memory", float64(hb.FreeMemory), maxFreeMemB),
		checkFigure("ms_per_layer", hb.MsPerLayer, maxMsLayer),
		checkFigure("stats.rpm1", st.RPM1, maxRate),
		checkFigure("stats.rpm5", st.RPM5, maxRate),
		checkFigure("stats.tokens_per_sec", st.TokensPerSec, maxRate),
		checkFigure("stats.hop_p50_ms", st.HopP50Ms, maxMs),
		checkFigure("stats.hop_p99_ms", st.HopP99Ms, maxMs),
		checkFigure("stats.sessions", float64(st.Sessions), maxCount),
		checkFigure("stats.running", float64(st.Running), maxCount),
		checkFigure("stats.queued", float64(st.Queued), maxCount),
		checkFigure("stats.hops_in_flight", float64(st.HopsInFlight), maxCount))
}

// checkLayerBytes checks a footprint's per-layer sizes: none, or one
// non-negative figure per layer.
func checkLayerBytes(b []int64, numLayers int) error {
	if len(b) != 0 && len(b) != numLayers {
		return fmt.Errorf("layer_bytes has %d entries for a model of %d layers", len(b), numLayers)
	}
	for _, n := range b {
		if n < 0 || n > route.MaxFootprintBytes {
			return fmt.Errorf("layer_bytes must be between 0 and %d", int64(route.MaxFootprintBytes))
		}
	}
	return nil
}

// Store is the registry's store.
func (g *Registry) Store() Store { return g.store }

// live lists unexpired records, deleting the expired ones. Caller holds mu.
func (g *Registry) live(ctx context.Context) ([]NodeRecord, error) {
	all, err := g.store.List(ctx)
	if err != nil {
		return nil, err
	}
	now := g.clock()
	out := all[:0]
	for _, rec := range all {
		if now.Sub(rec.LastSeen) > g.timeout {
			if err := g.store.Delete(ctx, rec); err != nil {
				return nil, err
			}
			continue
		}
		out = append(out, rec)
	}
	return out, nil
}

// casAttempts bounds the retries of a write that lost a race with another
// tracker (Store.Put's ErrConflict).
const casAttempts = 8

// retry runs op (holding mu) again while its conditional write conflicts.
type tombstone struct {
	ts    int64     // the goodbye's signed timestamp (unix ms)
	until time.Time // dropped after this
}

const maxTombstones = 10000

// bury records peerID's goodbye signed at ts; g.mu held.
func (g *Registry) bury(peerID string, ts int64) {
	now := g.clock()
	if g.tombs == nil {
		g.tombs = map[string]tombstone{}
	}
	if len(g.tombs) >= maxTombstones {
		for id, t := range g.tombs {
			if !now.Before(t.until) {
				delete(g.tombs, id)
			}
		}
		for id := range g.tombs { // still full: drop any
			if len(g.tombs) < maxTombstones {
				break
			}
			delete(g.tombs, id)
		}
	}
	// A message signed before ts passes verify until its timestamp is
	// maxSkew old, and ts may be maxSkew ahead of this clock.
	g.tombs[peerID] = tombstone{ts: ts, until: later(now, time.UnixMilli(ts)).Add(g.maxSkew)}
}

// buried reports whether a message of peerID signed at ts predates its
// goodbye; g.mu held.
func (g *Registry) buried(peerID string, ts int64) error {
	t, ok := g.tombs[peerID]
	if !ok {
		return nil
	}
	if !g.clock().Before(t.until) {
		delete(g.tombs, peerID)
		return nil
	}
	if ts <= t.ts {
		return errf(401, "authentication_error", "timestamp %d is not newer than the node's deregistration: a message sent before the goodbye", ts)
	}
	return nil
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

func retry[T any](g *Registry, op func() (T, error)) (T, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for i := 1; ; i++ {
		v, err := op()
		if !errors.Is(err, ErrConflict) {
			return v, err
		}
		if i == casAttempts {
			return v, errf(503, "service_unavailable", "the mesh state kept changing during this request (%d tries); retry", i)
		}
	}
}

// Register verifies and stores a registration.
func (g *Registry) Register(ctx context.Context, body []byte) (NodeRecord, error) {
	var reg Registration
	if err := g.verify(body, KindRegister, &reg); err != nil {
		return NodeRecord{}, err
	}
	if err := g.checkJoinToken(reg.JoinToken); err != nil {
		return NodeRecord{}, err
	}
	if err := reg.validate(); err != nil {
		return NodeRecord{}, errf(400, "invalid_request_error", "%v", err)
	}
	verified, err := g.admit(ctx, &reg)
	if err != nil {
		return NodeRecord{}, err
	}
	source := sourceFrom(ctx)
	return retry(g, func() (NodeRecord, error) { return g.register(ctx, &reg, verified, source) })
}

// admit applies the admission rules to a signed, valid registration and
// returns how its addresses were verified.
func (g *Registry) admit(ctx context.Context, reg *Registration) (string, error) {
	old, known, err := g.store.Get(ctx, reg.PeerID)
	if err != nil {
		return "", err
	}
	known = known && g.clock().Sub(old.LastSeen) <= g.timeout // an expired record is gone
	// A replayed registration is refused before it can spend the node's
	// own rate budget (register checks again under the lock).
	if known && reg.Timestamp <= old.LastTimestamp {
		return "", errf(401, "authentication_error", "timestamp %d is not newer than the last accepted one: replayed message", reg.Timestamp)
	}
	if g.keyLimit != nil && !g.keyLimit.allow(reg.PeerID, time.Now()) {
		return "", errf(429, "rate_limit_error", "too many registrations of %s; slow down", reg.PeerID)
	}
	for field, addr := range map[string]string{"endpoint": reg.Endpoint, "relay_addr": reg.RelayAddr} {
		if addr == "" {
			continue
		}
		if err := g.policy.checkURL(ctx, field, addr); err != nil {
			return "", errf(400, "invalid_request_error", "%v", err)
		}
	}
	if g.challenge == nil {
		return "", nil
	}
	// A node registering again with nothing changed was proved already.
	if known && old.Verified != "" && old.PublicKey == reg.PublicKey && old.Endpoint == reg.Endpoint &&
		old.RelayAddr == reg.RelayAddr && old.Model == reg.Model && old.Layers == reg.Layers {
		return old.Verified, nil
	}
	return g.challenge.prove(ctx, reg)
}

// sameAddr compares two endpoint or relay URLs as the addresses they name.
func sameAddr(a, b string) bool {
	if a == "" || b == "" {
		return false
	}
	ua, errA := url.Parse(a)
	ub, errB := url.Parse(b)
	if errA != nil || errB != nil {
		return a == b
	}
	return strings.EqualFold(ua.Scheme, ub.Scheme) && strings.EqualFold(ua.Host, ub.Host) &&
		strings.TrimSuffix(ua.Path, "/") == strings.TrimSuffix(ub.Path, "/")
}

func (g *Registry) register(ctx context.Context, reg *Registration, verified, source string) (NodeRecord, error) {
	nodes, err := g.live(ctx)
	if err != nil {
		return NodeRecord{}, err
	}
	old, exists := NodeRecord{}, false
	if err := g.limits.check(nodes, reg, source); err != nil {
		return NodeRecord{}, err
	}
	for _, rec := range nodes {
		// A layer count contradicting other nodes of the model is no
		// refusal: each variant has its own (shape.go).
		if rec.PeerID == reg.PeerID {
			old, exists = rec, true
			continue
		}
		if sameAddr(rec.Endpoint, reg.Endpoint) || sameAddr(rec.RelayAddr, reg.RelayAddr) {
			if verified != VerifiedEndpoint && verified != VerifiedRelay {
				return NodeRecord{}, errf(409, "conflict_error", "%s is registered to another live node", firstNonEmpty(reg.Endpoint, reg.RelayAddr))
			}
			// The address has just answered as the registrant: the other
			// record is stale (that node left or changed its key).
			if err := g.store.Delete(ctx, rec); err != nil {
				return NodeRecord{}, err
			}
		}
	}
	if exists && reg.Timestamp <= old.LastTimestamp {
		return NodeRecord{}, errf(401, "authentication_error", "timestamp %d is not newer than the last accepted one: replayed message", reg.Timestamp)
	}
	if err := g.buried(reg.PeerID, reg.Timestamp); err != nil {
		return NodeRecord{}, err
	}
	now := g.clock()
	// A verified registration is the node (its key) starting afresh: a
	// ban from its previous life ends, so a restarted node is routed again
	// at once. A node that still fails is banned again on its next failure.
	if err := g.store.Unban(ctx, reg.PeerID); err != nil {
		return NodeRecord{}, err
	}
	if err := g.forgetAudit(ctx, reg.PeerID, reg.Variant.Fingerprint, exists && (!old.Variant.Same(reg.Variant) || old.Model != reg.Model)); err != nil {
		return NodeRecord{}, err
	}
	rec := NodeRecord{
		PeerID: reg.PeerID, PublicKey: reg.PublicKey, Endpoint: reg.Endpoint, RelayAddr: reg.RelayAddr,
		Model: reg.Model, Variant: reg.Variant, NumLayers: reg.NumLayers, Layers: reg.Layers, Backend: reg.Backend, Hidden: reg.Hidden,
		MemoryBudget: reg.MemoryBudget, FreeMemory: reg.FreeMemory, Footprint: reg.Footprint, MsPerLayer: reg.MsPerLayer,
		RegisteredAt: now, LastSeen: now, LastTimestamp: reg.Timestamp, Verified: verified, RelayDown: reg.RelayDown, Source: source,
		Replies: reg.Replies,
	}
	if exists {
		rec.RegisteredAt, rec.Stats, rec.Revision = old.RegisteredAt, old.Stats, old.Revision
		// A move order stays pending until the node shows up with the range.
		if old.Move != nil && (old.Move.First != reg.Layers[0] || old.Move.Last != reg.Layers[1]) {
			rec.Move, rec.MoveAt = old.Move, old.MoveAt
		}
		if old.RelayDown && reg.RelayDown {
			rec.RelayDownSince = old.RelayDownSince
		}
	}
	if rec.RelayDown && rec.RelayDownSince.IsZero() {
		rec.RelayDownSince = now
	}
	if err := g.store.Put(ctx, rec); err != nil {
		return NodeRecord{}, err
	}
	if err := g.store.Unreserve(ctx, reg.PeerID); err != nil {
		return NodeRecord{}, err
	}
	return rec, nil
}

// forgetAudit drops a passing audit status of a node that now holds other
// weights (changed: its live record says so; or the pass names another
// fingerprint, which also covers a node whose record expired in between):
// it was earned against replicas of the old variant, so the node is new to
// its new variant's replicas. A failed node stays excluded (the key is what
// is excluded, whatever it serves).
func (g *Registry) forgetAudit(ctx context.Context, peerID, fingerprint string, changed bool) error {
	statuses, err := g.store.Statuses(ctx)
	if err != nil {
		return err
	}
	st, ok := statuses[peerID]
	if !ok || st.Audit == AuditFailed || st.Audit == AuditTrusted || st.Audit == "" {
		return nil
	}
	if !changed && (st.Fingerprint == "" || st.Fingerprint == fingerprint) {
		return nil
	}
	return g.store.SetStatus(ctx, NodeStatus{PeerID: peerID, Failures: st.Failures, At: g.clock()})
}

func (g *Registry) verify(body []byte, kind string, msg signable) error {
	err := verify(body, kind, g.clock(), g.maxSkew, msg)
	var br *badRequest
	var ae *authError
	switch {
	case errors.As(err, &br):
		return errf(400, "invalid_request_error", "%s", br.msg)
	case errors.As(err, &ae):
		return errf(401, "authentication_error", "%s", ae.msg)
	}
	return err
}

// Heartbeat verifies and applies a heartbeat; the response may carry a
// move order.
func (g *Registry) Heartbeat(ctx context.Context, body []byte) (HeartbeatResponse, error) {
	var hb Heartbeat
	if err := g.verify(body, KindHeartbeat, &hb); err != nil {
		return HeartbeatResponse{}, err
	}
	if err := hb.validate(); err != nil {
		return HeartbeatResponse{}, errf(400, "invalid_request_error", "%v", err)
	}
	synced := false
	return retry(g, func() (HeartbeatResponse, error) {
		resp, err := g.heartbeat(ctx, &hb)
		var ae *apiError
		if !synced && errors.As(err, &ae) && ae.Status == 404 {
			// The node may have registered through another tracker an
			// instant ago: look again once this view has caught up.
			synced = true
			if err := g.store.Sync(ctx); err != nil {
				return HeartbeatResponse{}, err
			}
			return HeartbeatResponse{}, ErrConflict
		}
		return resp, err
	})
}

func (g *Registry) heartbeat(ctx context.Context, hb *Heartbeat) (HeartbeatResponse, error) {
	nodes, err := g.live(ctx)
	if err != nil {
		return HeartbeatResponse{}, err
	}
	idx := -1
	for i, rec := range nodes {
		if rec.PeerID == hb.PeerID {
			idx = i
		}
	}
	if idx < 0 {
		return HeartbeatResponse{}, errf(404, "not_found_error", "peer %s is not registered (or expired): register again", hb.PeerID)
	}
	rec := nodes[idx]
	if rec.PublicKey != hb.PublicKey {
		return HeartbeatResponse{}, errf(401, "authentication_error", "public key differs from the registered one")
	}
	if hb.Timestamp <= rec.LastTimestamp {
		return HeartbeatResponse{}, errf(401, "authentication_error", "timestamp %d is not newer than the last accepted one: replayed message", hb.Timestamp)
	}
	if err := g.buried(hb.PeerID, hb.Timestamp); err != nil {
		return HeartbeatResponse{}, err
	}
	now := g.clock()
	// Back on its relay, a relay-only node (no other way to it) loses the
	// bans it got during the outage: those failures were the path's. A
	// node with an endpoint was routed directly meanwhile, so its bans are
	// its own; a ban from before the outage stays too.
	unbanSince := time.Time{}
	if rec.unreachable() && !hb.RelayDown && !rec.RelayDownSince.IsZero() {
		unbanSince = rec.RelayDownSince
	}
	switch {
	case !hb.RelayDown:
		rec.RelayDownSince = time.Time{}
	case rec.RelayDownSince.IsZero():
		rec.RelayDownSince = now
	}
	rec.RelayDown = hb.RelayDown
	rec.LastSeen, rec.LastTimestamp, rec.FreeMemory, rec.Stats = now, hb.Timestamp, hb.FreeMemory, hb.Stats
	if hb.MsPerLayer > 0 {
		rec.MsPerLayer = hb.MsPerLayer
	}
	if rec.Move == nil && !g.movePending(nodes, rec, now) {
		if a, ok := g.rebalance(nodes, idx); ok {
			rec.Move, rec.MoveAt = &Range{First: a.First, Last: a.Last}, now
		}
	}
	if rec.Move != nil && now.Sub(rec.MoveAt) > g.moveWait {
		rec.Move = nil // the node did not follow; another may be asked
	}
	if err := g.store.Put(ctx, rec); err != nil {
		return HeartbeatResponse{}, err
	}
	if !unbanSince.IsZero() {
		if err := g.store.UnbanSince(ctx, rec.PeerID, unbanSince); err != nil {
			return HeartbeatResponse{}, err
		}
	}
	trackers, err := g.store.Trackers(ctx)
	if err != nil {
		return HeartbeatResponse{}, err
	}
	nodes[idx] = rec
	ok, why, err := g.routable(ctx, nodes, rec)
	if err != nil {
		return HeartbeatResponse{}, err
	}
	return HeartbeatResponse{Move: rec.Move, Trackers: trackers, Routable: &ok, NotRoutable: why}, nil
}

// Deregister verifies a node's goodbye and forgets it: routes leave it at
// once (a draining node finishes the sessions it has). Unknown nodes are
// no error: the goodbye may come after an expiry or a tracker restart.
func (g *Registry) Deregister(ctx context.Context, body []byte) (struct{}, error) {
	var d Deregistration
	if err := g.verify(body, KindDeregister, &d); err != nil {
		return struct{}{}, err
	}
	return retry(g, func() (struct{}, error) {
		rec, ok, err := g.store.Get(ctx, d.PeerID)
		if err != nil {
			return struct{}{}, err
		}
		if !ok {
			if t, had := g.tombs[d.PeerID]; !had || d.Timestamp > t.ts {
				g.bury(d.PeerID, d.Timestamp) // a registration may still be on its way
			}
			return struct{}{}, nil
		}
		if rec.PublicKey != d.PublicKey {
			return struct{}{}, errf(401, "authentication_error", "public key differs from the registered one")
		}
		if d.Timestamp <= rec.LastTimestamp {
			return struct{}{}, errf(401, "authentication_error", "timestamp %d is not newer than the last accepted one: replayed message", d.Timestamp)
		}
		if err := g.store.Delete(ctx, rec); err != nil {
			return struct{}{}, err
		}
		if _, still, err := g.store.Get(ctx, d.PeerID); err != nil || still {
			return struct{}{}, cmp.Or(err, ErrConflict) // a heartbeat wrote it meanwhile: again
		}
		g.bury(d.PeerID, d.Timestamp)
		return struct{}{}, g.store.Unreserve(ctx, d.PeerID)
	})
}

// Routable says whether routes may run through the live node peerID now,
// and why not (a registration's answer carries it, as heartbeats' do).
func (g *Registry) Routable(ctx context.Context, peerID string) (bool, string, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	nodes, err := g.live(ctx)
	if err != nil {
		return false, "", err
	}
	for _, rec := range nodes {
		if rec.PeerID == peerID {
			return g.routable(ctx, nodes, rec)
		}
	}
	return false, "not registered", nil
}

// movePending says whether a node of me's model and variant has a move
// order pending: one at a time per variant, whose coverage it fills.
func (g *Registry) movePending(nodes []NodeRecord, me NodeRecord, now time.Time) bool {
	for _, rec := range nodes {
		if rec.Model == me.Model && rec.Variant.Same(me.Variant) && rec.NumLayers == me.NumLayers && rec.Move != nil && now.Sub(rec.MoveAt) <= g.moveWait {
			return true
		}
	}
	return false
}

// rebalance asks planning whether nodes[i] should move, within its
// variant: a gap of another variant is not one this node's weights fill.
func (g *Registry) rebalance(nodes []NodeRecord, i int) (route.Assignment, bool) {
	me := nodes[i]
	if me.MemoryBudget <= 0 || me.BytesPerLayer <= 0 {
		return route.Assignment{}, false // the node did not say what fits
	}
	var same []route.Node
	mover := -1
	for _, rec := range nodes {
		if rec.Model != me.Model || !rec.Variant.Same(me.Variant) || rec.NumLayers != me.NumLayers {
			continue
		}
		if rec.PeerID == me.PeerID {
			mover = len(same)
		}
		same = append(same, rec.routeNode())
	}
	return route.Rebalance(same, mover, me.NumLayers, me.routeFootprint(), 3, g.cfg)
}

func (r NodeRecord) routeFootprint() route.Footprint {
	return route.Footprint{Budget: r.MemoryBudget, BytesPerLayer: r.BytesPerLayer, KVReservePerLayer: r.KVReservePerLayer, EmbedBytes: r.EmbedBytes, HeadBytes: r.HeadBytes,
		LayerBytes: r.LayerBytes}
}

// Assign picks the range for a joining node and reserves it for a while.
func (g *Registry) Assign(ctx context.Context, body []byte) (AssignResponse, error) {
	var req AssignRequest
	if err := g.verify(body, KindAssign, &req); err != nil {
		return AssignResponse{}, err
	}
	if err := g.checkJoinToken(req.JoinToken); err != nil {
		return AssignResponse{}, err
	}
	if !modelName.MatchString(req.Model) {
		return AssignResponse{}, errf(400, "invalid_request_error", "model must be 1-128 characters of [A-Za-z0-9._:/@+-]")
	}
	if req.NumLayers <= 0 || req.NumLayers > MaxLayers {
		return AssignResponse{}, errf(400, "invalid_request_error", "num_layers %d is out of range 1-%d", req.NumLayers, MaxLayers)
	}
	if req.MsPerLayer < 0 {
		return AssignResponse{}, errf(400, "invalid_request_error", "ms_per_layer must be non-negative")
	}
	if err := req.Variant.Validate(); err != nil {
		return AssignResponse{}, errf(400, "invalid_request_error", "%v", err)
	}
	if err := checkLayerBytes(req.LayerBytes, req.NumLayers); err != nil {
		return AssignResponse{}, errf(400, "invalid_request_error", "%v", err)
	}
	fp := route.Footprint{Budget: req.MemoryBudget, BytesPerLayer: req.BytesPerLayer, KVReservePerLayer: req.KVReservePerLayer, EmbedBytes: req.EmbedBytes, HeadBytes: req.HeadBytes,
		LayerBytes: req.LayerBytes}
	if err := fp.Validate(); err != nil {
		return AssignResponse{}, errf(400, "invalid_request_error", "%v", err)
	}
	return retry(g, func() (AssignResponse, error) { return g.assign(ctx, &req, fp) })
}

func (g *Registry) assign(ctx context.Context, req *AssignRequest, fp route.Footprint) (AssignResponse, error) {
	nodes, err := g.live(ctx)
	if err != nil {
		return AssignResponse{}, err
	}
	now := g.clock()
	// The range fills the coverage of the joiner's own variant: layers
	// held only in other weights are gaps for it.
	var same []route.Node
	for _, rec := range nodes {
		// Nodes of another layer count are another shape (shape.go): not
		// the coverage this joiner fills.
		if rec.Model == req.Model && rec.PeerID != req.PeerID && rec.Variant.Same(req.Variant) && rec.NumLayers == req.NumLayers {
			same = append(same, rec.routeNode())
		}
	}
	reserved, token, err := g.store.Reservations(ctx, req.Model, now)
	if err != nil {
		return AssignResponse{}, err
	}
	for _, r := range reserved {
		if r.PeerID != req.PeerID && r.Variant == req.Variant.Fingerprint {
			same = append(same, route.Node{PeerID: r.PeerID, First: r.First, Last: r.Last, MsPerLayer: r.MsPerLayer})
		}
	}
	a, err := route.Assign(same, req.NumLayers, fp, req.MsPerLayer, g.cfg)
	if errors.Is(err, route.ErrDoesNotFit) {
		need := fp.BytesPerLayer + fp.KVReservePerLayer
		return AssignResponse{}, errf(422, "invalid_request_error",
			"%v: the budget is %s and one layer needs %s (%s of weights, %s of KV reserve); give the node --memory-budget %s or more, or lower its --max-sessions or --max-context to shrink the KV reserve",
			err, humanBytes(fp.Budget), humanBytes(need), humanBytes(fp.BytesPerLayer), humanBytes(fp.KVReservePerLayer), budgetFlag(need))
	}
	if err != nil {
		return AssignResponse{}, errf(400, "invalid_request_error", "%v", err)
	}
	r := Reservation{PeerID: req.PeerID, Model: req.Model, Variant: req.Variant.Fingerprint, First: a.First, Last: a.Last, MsPerLayer: req.MsPerLayer,
		Expiry: now.Add(2 * g.timeout)}
	if err := g.store.Reserve(ctx, r, token, 2*g.timeout); err != nil {
		return AssignResponse{}, err
	}
	return AssignResponse{Assignment: a}, nil
}

// Nodes lists the live records.
func (g *Registry) Nodes(ctx context.Context) ([]NodeRecord, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.live(ctx)
}

// Models lists the models with at least one live node, sorted.
func (g *Registry) Models(ctx context.Context) ([]string, error) {
	nodes, err := g.Nodes(ctx)
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	out := []string{}
	for _, rec := range nodes {
		if !seen[rec.Model] {
			seen[rec.Model] = true
			out = append(out, rec.Model)
		}
	}
	sort.Strings(out)
	return out, nil
}

// provenModels lists the models with a live node that proved itself at
// its address (the identity challenge; every node when this tracker
// challenges none) and is not failed by an audit: per-layer metrics are
// kept for those only.
func (g *Registry) provenModels(ctx context.Context) (map[string]bool, error) {
	nodes, err := g.Nodes(ctx)
	if err != nil {
		return nil, err
	}
	statuses, err := g.store.Statuses(ctx)
	if err != nil {
		return nil, err
	}
	out := map[string]bool{}
	for _, r := range nodes {
		if (r.Verified != "" || g.challenge == nil) && statuses[r.PeerID].Audit != AuditFailed {
			out[r.Model] = true
		}
	}
	return out, nil
}

// AvailabilityMap is GET /map's answer. Layers counts the nodes of every
// variant of the model's most common layer count; a route needs one
// variant covering every layer, which Covered says and Variants details.
type AvailabilityMap struct {
	Model     string                `json:"model"`
	NumLayers int                   `json:"num_layers"`
	Covered   bool                  `json:"covered"` // some variant's nodes cover every layer: the model is served
	Layers    []route.LayerCoverage `json:"layers"`
	Variants  []VariantCoverage     `json:"variants"`
}

// VariantCoverage is the availability map of one variant of a model.
type VariantCoverage struct {
	wire.Variant
	NumLayers int                   `json:"num_layers"` // each variant has its own (shape.go)
	Covered   bool                  `json:"covered"`
	Nodes     int                   `json:"nodes"`
	Layers    []route.LayerCoverage `json:"layers"`
}

// Map returns the availability map of model.
func (g *Registry) Map(ctx context.Context, model string) (AvailabilityMap, error) {
	maps, err := g.Maps(ctx, model)
	if err != nil {
		return AvailabilityMap{}, err
	}
	if len(maps) == 0 {
		return AvailabilityMap{}, errf(404, "not_found_error", "no live node serves model %q", model)
	}
	return maps[0], nil
}

// Maps returns the availability maps of every model with a live node
// (only model's when it is not ""), sorted by model, from one read of the
// records: the mesh page, /v1/models and /metrics ask for all of them.
func (g *Registry) Maps(ctx context.Context, model string) ([]AvailabilityMap, error) {
	all, err := g.Nodes(ctx)
	if err != nil {
		return nil, err
	}
	byModel := map[string][]NodeRecord{}
	for _, r := range g.shaped(all, g.statusesOf(ctx)) {
		if model == "" || r.Model == model {
			byModel[r.Model] = append(byModel[r.Model], r)
		}
	}
	out := make([]AvailabilityMap, 0, len(byModel))
	for m, recs := range byModel {
		out = append(out, g.availability(m, recs))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Model < out[j].Model })
	return out, nil
}

// availability maps one model's live records.
func (g *Registry) availability(model string, recs []NodeRecord) AvailabilityMap {
	// A relay-only node whose relay is down cannot be routed: it covers
	// nothing until it is back, or /map would say covered while chats
	// get 503 relay_unavailable.
	nodes := make([]route.Node, 0, len(recs))
	perCount := map[int]int{}
	for _, r := range recs {
		perCount[r.NumLayers]++
		if !r.unreachable() {
			nodes = append(nodes, r.routeNode())
		}
	}
	layers := 0 // the most common count (ties: the smaller)
	for n, k := range perCount {
		if k > perCount[layers] || (k == perCount[layers] && n < layers) {
			layers = n
		}
	}
	var common []route.Node
	for _, n := range nodes {
		if n.NumLayers == layers {
			common = append(common, n)
		}
	}
	m := AvailabilityMap{Model: model, NumLayers: layers, Layers: route.Coverage(common, layers, g.cfg), Variants: []VariantCoverage{}}
	for _, group := range route.ByVariant(nodes, nil) {
		n := group[0].NumLayers
		v := VariantCoverage{Variant: group[0].Variant, NumLayers: n, Covered: true, Nodes: len(group), Layers: route.Coverage(group, n, g.cfg)}
		for _, c := range v.Layers {
			if c.Replicas == 0 {
				v.Covered = false
			}
		}
		m.Covered = m.Covered || v.Covered
		m.Variants = append(m.Variants, v)
	}
	// People read labels; fingerprints keep the order stable.
	sort.SliceStable(m.Variants, func(i, j int) bool { return m.Variants[i].Label < m.Variants[j].Label })
	return m
}

// Ban keeps peerID out of routes until now+d, on every tracker sharing
// the store.
func (g *Registry) Ban(ctx context.Context, peerID string, d time.Duration) error {
	return g.store.Ban(ctx, peerID, g.clock().Add(d), d)
}

// SetStatus records a node's status (audits, issue 14); a failed audit
// keeps the node out of routes on every tracker sharing the store.
func (g *Registry) SetStatus(ctx context.Context, st NodeStatus) error {
	if st.At.IsZero() {
		st.At = g.clock()
	}
	return g.store.SetStatus(ctx, st)
}

// SetInflightRPM sets the hops per minute one proxied generation is
// assumed to add to each node of its route (default 600: 10 tokens/s).
func (g *Registry) SetInflightRPM(rpm float64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.inflight = map[string]int{}
	g.inflightRPM = rpm
}

// Acquire counts a generation on the route's nodes until release is
// called (once).
func (g *Registry) Acquire(r route.Route) (release func()) {
	g.mu.Lock()
	for _, h := range r.Hops {
		g.inflight[h.PeerID]++
	}
	g.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			g.mu.Lock()
			defer g.mu.Unlock()
			for _, h := range r.Hops {
				if g.inflight[h.PeerID]--; g.inflight[h.PeerID] <= 0 {
					delete(g.inflight, h.PeerID)
				}
			}
		})
	}
}

// ErrAvoided comes with a route that runs through a node the caller asked
// to avoid, because no other covers its layers.
var ErrAvoided = errors.New("route runs through a busy node: no other replica")

// Route picks the cheapest route for model, skipping banned nodes.
//
// It reads the records in place (Store.View) rather than through Nodes:
// with a thousand nodes, copying every record per request costs more than
// the route itself (docs/performance.md).
func (g *Registry) Route(ctx context.Context, model string, seed uint64) (route.Route, error) {
	return g.RouteAvoiding(ctx, model, seed, nil)
}

// RouteAvoiding is Route that also leaves out the nodes avoid reports
// (busy for this request); when that leaves no route, it routes over them
// anyway and reports ErrAvoided with the route, so the caller can wait.
func (g *Registry) RouteAvoiding(ctx context.Context, model string, seed uint64, avoid func(peerID string) bool) (route.Route, error) {
	return g.RouteVariant(ctx, model, nil, seed, avoid)
}

// RouteVariant is RouteAvoiding within one variant when variant (a
// fingerprint) is not nil: a generation that has streamed tokens goes on
// with the weights that chose them. With nil every variant is tried and
// the cheapest route wins; a route never mixes variants.
func (g *Registry) RouteVariant(ctx context.Context, model string, variant *string, seed uint64, avoid func(peerID string) bool) (route.Route, error) {
	now := g.clock()
	var nodes []route.Node
	var down []NodeRecord // relay-only nodes whose relay connection is down
	tied := ""            // a variant none of whose nodes is routed: their layer counts tie (shape.go)
	layers := 0
	replies := map[string]Replies{} // what each node said about direct replies, for the route's ticket
	err := g.store.View(ctx, func(recs []NodeRecord) error {
		live := func(r *NodeRecord) bool { return r.Model == model && now.Sub(r.LastSeen) <= g.timeout }
		won := g.electShapes(recs, live, g.statusesOf(ctx))
		for i := range recs {
			r := &recs[i]
			if !live(r) {
				continue
			}
			if n, ok := won[keyOf(r)]; ok && n != r.NumLayers {
				if n == 0 && (variant == nil || r.Variant.Fingerprint == *variant) {
					tied = r.Variant.String()
				}
				continue
			}
			nodes = append(nodes, r.routeNode())
			replies[r.PeerID] = r.Replies
			layers = r.NumLayers
			if r.unreachable() && (variant == nil || r.Variant.Fingerprint == *variant) {
				down = append(down, *r)
			}
		}
		return nil
	})
	if err != nil {
		return route.Route{}, err
	}
	if len(nodes) == 0 && tied != "" {
		return route.Route{}, errf(503, typeShapeTie, "%s", shapeTie(model, tied))
	}
	if len(nodes) == 0 {
		return route.Route{}, errf(404, "not_found_error", "no live node serves model %q yet: start a node with --model %s and --tracker pointing here (GET /nodes lists the registered ones)", model, model)
	}
	banned, err := g.excluded(ctx, nodes, now)
	if err != nil {
		return route.Route{}, err
	}
	nBanned := len(banned)
	ownBans := make(map[string]bool, nBanned) // the bans without the relay outages
	for id := range banned {
		ownBans[id] = true
	}
	for _, r := range down {
		banned[r.PeerID] = true
	}
	g.mu.Lock()
	g.applyMeasured(nodes)
	for i := range nodes {
		own := float64(g.inflight[nodes[i].PeerID])
		nodes[i].RPM1 += own * g.inflightRPM
		// The heartbeat's count includes this tracker's generations of a
		// few seconds ago; ours are current: the larger one, not the sum.
		nodes[i].InFlight = max(nodes[i].InFlight, own)
	}
	g.mu.Unlock()
	find := func(exclude func(string) bool) (route.Route, error) {
		r, err := route.Find(nodes, layers, route.Options{Seed: seed, Variant: variant, Exclude: exclude}, g.cfg)
		if err == nil {
			r = withReplies(r, replies)
		}
		return r, err
	}
	notBanned := func(id string) bool { return banned[id] }
	if avoid != nil {
		if r, err := find(func(id string) bool { return banned[id] || avoid(id) }); err == nil {
			return r, nil
		}
		if r, err := find(notBanned); err == nil {
			return r, ErrAvoided
		}
	}
	r, err := find(notBanned)
	if errors.Is(err, route.ErrNoRoute) {
		groups := route.ByVariant(nodes, nil)
		counts := fmt.Sprintf("%d live nodes in %d variants, %d banned", len(nodes), len(groups), nBanned)
		if len(down) > 0 && func() bool {
			// Only when the outages make the gap: with them up there is a
			// route (the gap is not elsewhere, nor in another variant).
			_, err := route.Find(nodes, layers, route.Options{Seed: seed, Variant: variant, Exclude: func(id string) bool { return ownBans[id] }}, g.cfg)
			return err == nil
		}() {
			// The node is fine; its path is not. Say which relay, so the
			// operator looks there, and that no ban is involved.
			return route.Route{}, errf(503, wire.TypeRelayUnavailable, "model %s: no route: %s, and no other node covers their layers (%s); they are routed again as soon as they reconnect",
				model, describeDown(down), counts)
		}
		if variant != nil {
			return route.Route{}, errf(503, "service_unavailable", "model %s, variant %s: %v (%s); a generation stays on its variant",
				model, *variant, err, counts)
		}
		return route.Route{}, errf(503, "service_unavailable", "model %s: %v of one variant (%s)", model, err, counts)
	}
	return r, err
}

// withReplies sets r.DirectReplies when the route's head asked for direct
// replies and every node on it registered that it reads route tickets
// naming the head's address: one older node, and the ticket stays one it
// reads (an unknown version is refused, 403 invalid_ticket, and banned).
func withReplies(r route.Route, replies map[string]Replies) route.Route {
	if len(r.Hops) < 2 || !replies[r.Hops[0].PeerID].DirectReplies {
		return r
	}
	for _, h := range r.Hops {
		if !replies[h.PeerID].readsHeadAddress() {
			return r
		}
	}
	r.DirectReplies = true
	return r
}

// excluded returns the nodes routes leave out: banned ones and those their
// audit status excludes.
func (g *Registry) excluded(ctx context.Context, nodes []route.Node, now time.Time) (map[string]bool, error) {
	bans, err := g.store.Bans(ctx, now)
	if err != nil {
		return nil, err
	}
	statuses, err := g.store.Statuses(ctx)
	if err != nil {
		return nil, err
	}
	out := make(map[string]bool, len(bans))
	for id := range bans {
		out[id] = true
	}
	for id := range g.auditExcluded(nodes, statuses, bans, now) {
		out[id] = true
	}
	return out, nil
}

// unreachable: the node has no endpoint and says its relay connection is
// down, so nothing can reach it until it reconnects.
func (r NodeRecord) unreachable() bool { return r.RelayDown && r.Endpoint == "" }

// describeDown names relay-only nodes that are cut off and their relays:
// "mg-… (layers 4-5) is not connected to relay ws://host:7000".
func describeDown(down []NodeRecord) string {
	var parts []string
	for i, r := range down {
		if i == 3 {
			parts = append(parts, fmt.Sprintf("and %d more", len(down)-i))
			break
		}
		parts = append(parts, fmt.Sprintf("%s (layers %d-%d) is not connected to relay %s", r.PeerID, r.Layers[0], r.Layers[1], relayBase(r.RelayAddr)))
	}
	return strings.Join(parts, "; ")
}

// relayBase is the relay of a relay_addr (ws://host:port/rpc/{peer id}).
func relayBase(relayAddr string) string {
	if i := strings.Index(relayAddr, "/rpc/"); i >= 0 {
		return relayAddr[:i]
	}
	return relayAddr
}

// routable says whether routes may run through rec now: it is reachable,
// not excluded, and the reachable, usable nodes of its model and variant
// cover every layer (then some route passes through any one of them, as a
// route may enter and leave a node's range anywhere). Caller holds mu;
// nodes are the live records.
func (g *Registry) routable(ctx context.Context, nodes []NodeRecord, rec NodeRecord) (bool, string, error) {
	if rec.unreachable() {
		return false, "not connected to relay " + relayBase(rec.RelayAddr), nil
	}
	if why := g.givesWay(nodes, rec, g.statusesOf(ctx)); why != "" {
		return false, why, nil
	}
	var group []route.Node
	for _, n := range nodes {
		if n.Model == rec.Model && n.Variant.Same(rec.Variant) && n.NumLayers == rec.NumLayers && !n.unreachable() {
			group = append(group, n.routeNode())
		}
	}
	ex, err := g.excluded(ctx, group, g.clock())
	if err != nil {
		return false, "", err
	}
	if ex[rec.PeerID] {
		return false, "banned or excluded by an audit (GET /nodes on the tracker shows its audit status)", nil
	}
	var usable []route.Node
	for _, n := range group {
		if !ex[n.PeerID] {
			usable = append(usable, n)
		}
	}
	var gaps []int
	for _, c := range route.Coverage(usable, rec.NumLayers, g.cfg) {
		if c.Replicas == 0 {
			gaps = append(gaps, c.Layer)
		}
	}
	if len(gaps) > 0 {
		return false, fmt.Sprintf("no usable node of this variant holds layers %s of %s yet", layerRanges(gaps), rec.Model), nil
	}
	return true, "", nil
}

// humanBytes writes n in binary units with one decimal: "65.4 MiB".
func humanBytes(n int64) string {
	f, units := float64(n), []string{"B", "KiB", "MiB", "GiB", "TiB"}
	i := 0
	for f >= 1024 && i < len(units)-1 {
		f /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("%.1f %s", f, units[i])
}

// budgetFlag is the smallest whole MiB (or GiB above 10 GiB) at least n,
// as --memory-budget reads it.
func budgetFlag(n int64) string {
	if n > 10<<30 {
		return fmt.Sprintf("%dGiB", (n+1<<30-1)>>30)
	}
	return fmt.Sprintf("%dMiB", (n+1<<20-1)>>20)
}

// layerRanges writes sorted layers as ranges: "3-5,7".
func layerRanges(ls []int) string {
	var b strings.Builder
	for i := 0; i < len(ls); {
		j := i
		for j+1 < len(ls) && ls[j+1] == ls[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%d", ls[i])
		if j > i {
			fmt.Fprintf(&b, "-%d", ls[j])
		}
		i = j + 1
	}
	return b.String()
}
