package tracker

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"sort"
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

	mu       sync.Mutex // serializes check-then-write on the store
	bans     map[string]time.Time
	reserved map[string]reservation
	// inflight counts the proxied generations using each node now; each
	// adds inflightRPM to the node's reported RPM when routing, so
	// concurrent streams spread before heartbeats report the load.
	inflight    map[string]int
	inflightRPM float64
}

// reservation holds an assigned range for a node that has not registered
// yet, so concurrent joiners do not all get the same range.
type reservation struct {
	model  string
	node   route.Node
	expiry time.Time
}

// NewRegistry returns a registry over store (nil: a MemStore).
func NewRegistry(store Store, clock func() time.Time, heartbeatTimeout, maxSkew time.Duration, cfg route.Config) *Registry {
	if store == nil {
		store = &MemStore{}
	}
	if clock == nil {
		clock = time.Now
	}
	if heartbeatTimeout <= 0 {
		heartbeatTimeout = 15 * time.Second
	}
	if maxSkew <= 0 {
		maxSkew = 2 * time.Minute
	}
	return &Registry{
		store: store, clock: clock, timeout: heartbeatTimeout, maxSkew: maxSkew, cfg: cfg,
		moveWait: 4 * heartbeatTimeout,
		bans:     map[string]time.Time{}, reserved: map[string]reservation{},
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
	if reg.MsPerLayer < 0 || reg.MsPerLayer > 1e6 || reg.MemoryBudget < 0 || reg.FreeMemory < 0 ||
		reg.BytesPerLayer < 0 || reg.KVReservePerLayer < 0 || reg.EmbedBytes < 0 || reg.HeadBytes < 0 {
		return errors.New("memory figures and ms_per_layer must be non-negative")
	}
	if len(reg.Backend) > 64 {
		return errors.New("backend name is longer than 64 bytes")
	}
	return nil
}

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
			if err := g.store.Delete(ctx, rec.PeerID); err != nil {
				return nil, err
			}
			continue
		}
		out = append(out, rec)
	}
	return out, nil
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
	g.mu.Lock()
	defer g.mu.Unlock()
	nodes, err := g.live(ctx)
	if err != nil {
		return NodeRecord{}, err
	}
	old, exists := NodeRecord{}, false
	for _, rec := range nodes {
		if rec.Model == reg.Model && rec.NumLayers != reg.NumLayers && rec.PeerID != reg.PeerID {
			return NodeRecord{}, errf(409, "conflict_error", "model %s has %d layers according to %s, not %d", reg.Model, rec.NumLayers, rec.PeerID, reg.NumLayers)
		}
		if rec.PeerID == reg.PeerID {
			old, exists = rec, true
		}
	}
	if exists && reg.Timestamp <= old.LastTimestamp {
		return NodeRecord{}, errf(401, "authentication_error", "timestamp %d is not newer than the last accepted one: replayed message", reg.Timestamp)
	}
	now := g.clock()
	// A verified registration is the node (its key) starting afresh: a
	// ban from its previous life ends, so a restarted node is routed again
	// at once. A node that still fails is banned again on its next failure.
	delete(g.bans, reg.PeerID)
	rec := NodeRecord{
		PeerID: reg.PeerID, PublicKey: reg.PublicKey, Endpoint: reg.Endpoint, RelayAddr: reg.RelayAddr,
		Model: reg.Model, NumLayers: reg.NumLayers, Layers: reg.Layers, Backend: reg.Backend, Hidden: reg.Hidden,
		MemoryBudget: reg.MemoryBudget, FreeMemory: reg.FreeMemory, Footprint: reg.Footprint, MsPerLayer: reg.MsPerLayer,
		RegisteredAt: now, LastSeen: now, LastTimestamp: reg.Timestamp,
	}
	if exists {
		rec.RegisteredAt, rec.Stats = old.RegisteredAt, old.Stats
		// A move order stays pending until the node shows up with the range.
		if old.Move != nil && (old.Move.First != reg.Layers[0] || old.Move.Last != reg.Layers[1]) {
			rec.Move, rec.MoveAt = old.Move, old.MoveAt
		}
	}
	delete(g.reserved, reg.PeerID)
	if err := g.store.Put(ctx, rec); err != nil {
		return NodeRecord{}, err
	}
	return rec, nil
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
	if hb.FreeMemory < 0 || hb.Stats.RPM1 < 0 || hb.Stats.RPM5 < 0 || hb.Stats.TokensPerSec < 0 || hb.Stats.Sessions < 0 ||
		hb.Stats.HopP50Ms < 0 || hb.Stats.HopP99Ms < 0 || hb.MsPerLayer < 0 || hb.MsPerLayer > 1e6 {
		return HeartbeatResponse{}, errf(400, "invalid_request_error", "heartbeat figures must be non-negative")
	}
	g.mu.Lock()
	defer g.mu.Unlock()
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
	now := g.clock()
	rec.LastSeen, rec.LastTimestamp, rec.FreeMemory, rec.Stats = now, hb.Timestamp, hb.FreeMemory, hb.Stats
	if hb.MsPerLayer > 0 {
		rec.MsPerLayer = hb.MsPerLayer
	}
	if rec.Move == nil && !g.movePending(nodes, rec.Model, now) {
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
	return HeartbeatResponse{Move: rec.Move}, nil
}

func (g *Registry) movePending(nodes []NodeRecord, model string, now time.Time) bool {
	for _, rec := range nodes {
		if rec.Model == model && rec.Move != nil && now.Sub(rec.MoveAt) <= g.moveWait {
			return true
		}
	}
	return false
}

// rebalance asks planning whether nodes[i] should move.
func (g *Registry) rebalance(nodes []NodeRecord, i int) (route.Assignment, bool) {
	me := nodes[i]
	if me.MemoryBudget <= 0 || me.BytesPerLayer <= 0 {
		return route.Assignment{}, false // the node did not say what fits
	}
	var same []route.Node
	mover := -1
	for _, rec := range nodes {
		if rec.Model != me.Model {
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
	return route.Footprint{Budget: r.MemoryBudget, BytesPerLayer: r.BytesPerLayer, KVReservePerLayer: r.KVReservePerLayer, EmbedBytes: r.EmbedBytes, HeadBytes: r.HeadBytes}
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
	fp := route.Footprint{Budget: req.MemoryBudget, BytesPerLayer: req.BytesPerLayer, KVReservePerLayer: req.KVReservePerLayer, EmbedBytes: req.EmbedBytes, HeadBytes: req.HeadBytes}
	if err := fp.Validate(); err != nil {
		return AssignResponse{}, errf(400, "invalid_request_error", "%v", err)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	nodes, err := g.live(ctx)
	if err != nil {
		return AssignResponse{}, err
	}
	now := g.clock()
	var same []route.Node
	for _, rec := range nodes {
		if rec.Model == req.Model && rec.PeerID != req.PeerID {
			if rec.NumLayers != req.NumLayers {
				return AssignResponse{}, errf(409, "conflict_error", "model %s has %d layers according to %s, not %d", req.Model, rec.NumLayers, rec.PeerID, req.NumLayers)
			}
			same = append(same, rec.routeNode())
		}
	}
	for id, r := range g.reserved {
		switch {
		case now.After(r.expiry):
			delete(g.reserved, id)
		case r.model == req.Model && id != req.PeerID:
			same = append(same, r.node)
		}
	}
	a, err := route.Assign(same, req.NumLayers, fp, req.MsPerLayer, g.cfg)
	if errors.Is(err, route.ErrDoesNotFit) {
		return AssignResponse{}, errf(422, "invalid_request_error", "%v (budget %d bytes, a layer needs %d)", err, fp.Budget, fp.BytesPerLayer+fp.KVReservePerLayer)
	}
	if err != nil {
		return AssignResponse{}, errf(400, "invalid_request_error", "%v", err)
	}
	g.reserved[req.PeerID] = reservation{
		model:  req.Model,
		node:   route.Node{PeerID: req.PeerID, First: a.First, Last: a.Last, MsPerLayer: req.MsPerLayer},
		expiry: now.Add(2 * g.timeout),
	}
	return AssignResponse{Assignment: a}, nil
}

// Nodes lists the live records.
func (g *Registry) Nodes(ctx context.Context) ([]NodeRecord, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.live(ctx)
}

// modelNodes returns the live records of model and its layer count.
func (g *Registry) modelNodes(ctx context.Context, model string) ([]NodeRecord, int, error) {
	nodes, err := g.Nodes(ctx)
	if err != nil {
		return nil, 0, err
	}
	var out []NodeRecord
	layers := 0
	for _, rec := range nodes {
		if rec.Model == model {
			out = append(out, rec)
			layers = rec.NumLayers
		}
	}
	if len(out) == 0 {
		return nil, 0, errf(404, "not_found_error", "no live node serves model %q", model)
	}
	return out, layers, nil
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

// AvailabilityMap is GET /map's answer.
type AvailabilityMap struct {
	Model     string                `json:"model"`
	NumLayers int                   `json:"num_layers"`
	Covered   bool                  `json:"covered"`
	Layers    []route.LayerCoverage `json:"layers"`
}

// Map returns the availability map of model.
func (g *Registry) Map(ctx context.Context, model string) (AvailabilityMap, error) {
	recs, layers, err := g.modelNodes(ctx, model)
	if err != nil {
		return AvailabilityMap{}, err
	}
	nodes := make([]route.Node, len(recs))
	for i, r := range recs {
		nodes[i] = r.routeNode()
	}
	m := AvailabilityMap{Model: model, NumLayers: layers, Covered: true, Layers: route.Coverage(nodes, layers, g.cfg)}
	for _, c := range m.Layers {
		if c.Replicas == 0 {
			m.Covered = false
		}
	}
	return m, nil
}

// Ban keeps peerID out of routes until now+d.
func (g *Registry) Ban(peerID string, d time.Duration) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.bans[peerID] = g.clock().Add(d)
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

// Route picks the cheapest route for model, skipping banned nodes.
func (g *Registry) Route(ctx context.Context, model string, seed uint64) (route.Route, error) {
	recs, layers, err := g.modelNodes(ctx, model)
	if err != nil {
		return route.Route{}, err
	}
	g.mu.Lock()
	now := g.clock()
	banned := map[string]bool{}
	for id, until := range g.bans {
		if now.After(until) {
			delete(g.bans, id)
		} else {
			banned[id] = true
		}
	}
	nodes := make([]route.Node, len(recs))
	for i, r := range recs {
		nodes[i] = r.routeNode()
		nodes[i].RPM1 += float64(g.inflight[r.PeerID]) * g.inflightRPM
	}
	g.mu.Unlock()
	r, err := route.Find(nodes, layers, route.Options{Seed: seed, Exclude: func(id string) bool { return banned[id] }}, g.cfg)
	if errors.Is(err, route.ErrNoRoute) {
		return route.Route{}, errf(503, "service_unavailable", "model %s: %v (%d live nodes, %d banned)", model, err, len(recs), len(banned))
	}
	return r, err
}
