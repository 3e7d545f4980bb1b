package tracker

import (
	"context"
	"sort"
	"sync"
)

// Store keeps node records. The tracker serializes its own writes; a
// Store must only be safe for concurrent use.
type Store interface {
	Put(ctx context.Context, rec NodeRecord) error
	// Get returns the record and whether it exists.
	Get(ctx context.Context, peerID string) (NodeRecord, bool, error)
	Delete(ctx context.Context, peerID string) error
	// List returns every record, sorted by peer id.
	List(ctx context.Context) ([]NodeRecord, error)
}

// MemStore is an in-memory Store; its zero value is ready.
type MemStore struct {
	mu    sync.Mutex
	nodes map[string]NodeRecord
}

func (m *MemStore) Put(_ context.Context, rec NodeRecord) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.nodes == nil {
		m.nodes = map[string]NodeRecord{}
	}
	m.nodes[rec.PeerID] = rec
	return nil
}

func (m *MemStore) Get(_ context.Context, peerID string) (NodeRecord, bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	rec, ok := m.nodes[peerID]
	return rec, ok, nil
}

func (m *MemStore) Delete(_ context.Context, peerID string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.nodes, peerID)
	return nil
}

func (m *MemStore) List(_ context.Context) ([]NodeRecord, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	// Sort the ids, not the records: records are large to swap.
	ids := make([]string, 0, len(m.nodes))
	for id := range m.nodes {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	out := make([]NodeRecord, len(ids))
	for i, id := range ids {
		out[i] = m.nodes[id]
	}
	return out, nil
}
