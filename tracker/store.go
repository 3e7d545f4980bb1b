package tracker

import (
	"context"
	"errors"
	"sort"
	"sync"
	"time"
)

// ErrConflict is a Store's answer to a conditional write whose condition no
// longer holds: another writer (possibly another tracker on the same etcd)
// changed the state since it was read. The Registry reads again and retries.
var ErrConflict = errors.New("tracker store: the state changed since it was read")

// Store keeps the state a mesh's trackers share: node records, bans,
// per-node status, assignment reservations and the trackers themselves.
// Reads must be cheap (route requests read on every call); writes that
// depend on what was read are conditional (compare-and-swap), so that the
// check-then-write rules of Registry hold across several trackers.
// A Store must be safe for concurrent use.
type Store interface {
	// List returns every node record, sorted by peer id, each with the
	// Revision it was stored at.
	List(ctx context.Context) ([]NodeRecord, error)
	// View calls fn with every node record, sorted by peer id, without
	// copying them: fn must not change or keep the slice (route requests
	// read through it).
	View(ctx context.Context, fn func([]NodeRecord) error) error
	// Get returns the record and whether it exists.
	Get(ctx context.Context, peerID string) (NodeRecord, bool, error)
	// Put writes rec when the stored record of rec.PeerID still has
	// rec.Revision (0: no record); otherwise it returns ErrConflict. Layer
	// counts of one model may differ (the registry elects one per
	// variant: shape.go). A record put
	// lives for the store's time-to-live unless put again (heartbeats).
	Put(ctx context.Context, rec NodeRecord) error
	// Delete removes rec when it is still at rec.Revision (an expired
	// record that nobody refreshed meanwhile); no error when it is not.
	Delete(ctx context.Context, rec NodeRecord) error

	// Ban keeps peerID out of routes until until; the entry may be
	// dropped after ttl.
	Ban(ctx context.Context, peerID string, until time.Time, ttl time.Duration) error
	// Unban ends peerID's ban, if any.
	Unban(ctx context.Context, peerID string) error
	// UnbanSince ends peerID's ban only when it began (until - ttl) at or
	// after since: a relay outage clears the bans it caused, not older ones.
	UnbanSince(ctx context.Context, peerID string, since time.Time) error
	// Bans returns the bans ending after now.
	Bans(ctx context.Context, now time.Time) (map[string]time.Time, error)

	// SetStatus records a node's status (audit results: issue 14).
	SetStatus(ctx context.Context, st NodeStatus) error
	// Statuses returns every recorded status by peer id.
	Statuses(ctx context.Context) (map[string]NodeStatus, error)

	// Reservations returns the unexpired reservations of model and a
	// token of that set; Reserve stores r only while the token is still
	// current (no concurrent assignment for the model), else ErrConflict.
	Reservations(ctx context.Context, model string, now time.Time) ([]Reservation, int64, error)
	Reserve(ctx context.Context, r Reservation, token int64, ttl time.Duration) error
	// Unreserve drops peerID's reservation (it registered).
	Unreserve(ctx context.Context, peerID string) error

	// Trackers lists the trackers serving the mesh (each publishes itself).
	Trackers(ctx context.Context) ([]TrackerInfo, error)

	// Sync brings this tracker's view up to every change already made by
	// any tracker: before answering "not registered" to a node that may
	// have registered through another tracker a moment ago.
	Sync(ctx context.Context) error
}

// NodeStatus is a node's standing beyond its own reports: its audits
// (tracker/audit.go). A node whose Audit is AuditFailed is not routed to
// until Until; see auditExcluded for the other statuses.
type NodeStatus struct {
	PeerID string `json:"peer_id"`
	Audit  string `json:"audit,omitempty"` // "" (none yet), AuditPassed, AuditFailed, AuditProbation, ...
	Detail string `json:"detail,omitempty"`
	// Failures counts the node's failed audits (the exclusion doubles).
	Failures int `json:"failures,omitempty"`
	// Passes counts its passed audits: its record, which weighs its
	// opinion as a referee (auditor.weight).
	Passes int `json:"passes,omitempty"`
	// With is the other node of a dispute (Audit == AuditDisputed).
	With  string    `json:"with,omitempty"`
	Until time.Time `json:"until,omitempty"` // end of a failed node's exclusion
	// Probation: the node has not passed its first audit yet.
	Probation bool `json:"probation,omitempty"`
	// Fingerprint is the variant a pass was earned on: a node that comes
	// back with other weights (even after its record expired) is new.
	Fingerprint string    `json:"fingerprint,omitempty"`
	At          time.Time `json:"at"`
}

// Audit outcomes.
const (
	AuditPassed = "passed"
	AuditFailed = "failed"
)

// Reservation holds an assigned range for a node that has not registered
// yet, so concurrent joiners do not all get the same range.
type Reservation struct {
	PeerID     string    `json:"peer_id"`
	Model      string    `json:"model"`
	Variant    string    `json:"variant,omitempty"` // the fingerprint of the node's variant
	First      int       `json:"first"`
	Last       int       `json:"last"`
	MsPerLayer float64   `json:"ms_per_layer"`
	Expiry     time.Time `json:"expiry"`
}

// TrackerInfo is one tracker of a mesh as published in the store: its
// identity (the key a later ticket-signing change signs with) and the URL
// nodes can reach it at.
type TrackerInfo struct {
	PeerID    string `json:"peer_id"`
	PublicKey string `json:"public_key"`
	URL       string `json:"url,omitempty"`
}

// MemStore is an in-memory Store for one tracker; its zero value is ready.
// Records have no time-to-live: the Registry drops expired ones.
type MemStore struct {
	mu       sync.Mutex
	rev      int64
	nodes    map[string]NodeRecord
	sorted   []NodeRecord // nodes by peer id, never changed in place; nil after a change
	bans     map[string]time.Time
	banStart map[string]time.Time
	status   map[string]NodeStatus
	reserved map[string]Reservation
	assigns  map[string]int64 // per model: revision of the last reservation
	trackers []TrackerInfo
}

// NewMemStore returns an empty MemStore that lists self as its tracker.
func NewMemStore(self TrackerInfo) *MemStore { return &MemStore{trackers: []TrackerInfo{self}} }

func (m *MemStore) init() {
	if m.nodes == nil {
		m.nodes, m.bans, m.status = map[string]NodeRecord{}, map[string]time.Time{}, map[string]NodeStatus{}
		m.reserved, m.assigns, m.banStart = map[string]Reservation{}, map[string]int64{}, map[string]time.Time{}
	}
}

func (m *MemStore) Put(_ context.Context, rec NodeRecord) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	if m.nodes[rec.PeerID].Revision != rec.Revision {
		return ErrConflict
	}
	m.rev++
	rec.Revision = m.rev
	m.nodes[rec.PeerID] = rec
	m.sorted = nil
	return nil
}

func (m *MemStore) Get(_ context.Context, peerID string) (NodeRecord, bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	rec, ok := m.nodes[peerID]
	return rec, ok, nil
}

func (m *MemStore) Delete(_ context.Context, rec NodeRecord) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if cur, ok := m.nodes[rec.PeerID]; ok && cur.Revision == rec.Revision {
		delete(m.nodes, rec.PeerID)
		m.sorted = nil
	}
	return nil
}

func (m *MemStore) List(_ context.Context) ([]NodeRecord, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return sortedRecords(m.nodes), nil
}

func (m *MemStore) View(_ context.Context, fn func([]NodeRecord) error) error {
	m.mu.Lock()
	if m.sorted == nil {
		m.sorted = sortedRecords(m.nodes)
	}
	recs := m.sorted
	m.mu.Unlock()
	return fn(recs)
}

// sortedRecords sorts the ids, not the records: records are large to swap.
func sortedRecords(nodes map[string]NodeRecord) []NodeRecord {
	ids := make([]string, 0, len(nodes))
	for id := range nodes {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	out := make([]NodeRecord, len(ids))
	for i, id := range ids {
		out[i] = nodes[id]
	}
	return out
}

func (m *MemStore) Ban(_ context.Context, peerID string, until time.Time, ttl time.Duration) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	m.bans[peerID], m.banStart[peerID] = until, until.Add(-ttl)
	return nil
}

func (m *MemStore) Unban(_ context.Context, peerID string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.bans, peerID)
	delete(m.banStart, peerID)
	return nil
}

func (m *MemStore) UnbanSince(_ context.Context, peerID string, since time.Time) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if start, ok := m.banStart[peerID]; ok && !start.Before(since) {
		delete(m.bans, peerID)
		delete(m.banStart, peerID)
	}
	return nil
}

func (m *MemStore) Bans(_ context.Context, now time.Time) (map[string]time.Time, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string]time.Time{}
	for id, until := range m.bans {
		if now.After(until) {
			delete(m.bans, id)
			delete(m.banStart, id)
		} else {
			out[id] = until
		}
	}
	return out, nil
}

func (m *MemStore) SetStatus(_ context.Context, st NodeStatus) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	m.status[st.PeerID] = st
	return nil
}

func (m *MemStore) Statuses(_ context.Context) (map[string]NodeStatus, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[string]NodeStatus, len(m.status))
	for id, st := range m.status {
		out[id] = st
	}
	return out, nil
}

func (m *MemStore) Reservations(_ context.Context, model string, now time.Time) ([]Reservation, int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []Reservation
	for id, r := range m.reserved {
		switch {
		case now.After(r.Expiry):
			delete(m.reserved, id)
		case r.Model == model:
			out = append(out, r)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].PeerID < out[j].PeerID })
	token := m.assigns[model]
	if len(out) == 0 { // keep the map bounded by the live reservations
		delete(m.assigns, model)
		token = 0
	}
	return out, token, nil
}

func (m *MemStore) Reserve(_ context.Context, r Reservation, token int64, _ time.Duration) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.init()
	if m.assigns[r.Model] != token {
		return ErrConflict
	}
	m.rev++
	m.assigns[r.Model] = m.rev
	m.reserved[r.PeerID] = r
	return nil
}

func (m *MemStore) Unreserve(_ context.Context, peerID string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.reserved, peerID)
	return nil
}

// Sync has nothing to do: the MemStore is the state.
func (m *MemStore) Sync(context.Context) error { return nil }

func (m *MemStore) Trackers(context.Context) ([]TrackerInfo, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]TrackerInfo(nil), m.trackers...), nil
}
