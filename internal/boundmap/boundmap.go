// Package boundmap is a map with a limit on its entries. A new key in a
// full map first evicts one entry that the owner's policy lets go, so
// whoever fills it (peers are free to make) moves one entry out at a
// time, never the whole set at once. It has no lock of its own.
package boundmap

import "iter"

// Map holds at most Max entries. The zero value with Max set is usable.
type Map[K comparable, V any] struct {
	// Max bounds the entries (at least 1).
	Max int
	// Evictable says whether an entry may go to make room; nil: any may.
	Evictable func(K, V) bool
	// Evicted, when set, is called with each entry evicted.
	Evicted func(K, V)

	m map[K]V
}

// Get returns k's value.
func (m *Map[K, V]) Get(k K) (V, bool) {
	v, ok := m.m[k]
	return v, ok
}

// Put stores v under k. A new key in a full map first evicts one entry
// that Evictable allows; when none may go, Put stores nothing and reports
// false (the caller refuses, or answers busy).
func (m *Map[K, V]) Put(k K, v V) bool {
	if m.m == nil {
		m.m = map[K]V{}
	}
	if _, ok := m.m[k]; !ok && len(m.m) >= max(m.Max, 1) && !m.evictOne() {
		return false
	}
	m.m[k] = v
	return true
}

// evictOne deletes one entry Evictable allows (map order: any of them).
func (m *Map[K, V]) evictOne() bool {
	for k, v := range m.m {
		if m.Evictable == nil || m.Evictable(k, v) {
			delete(m.m, k)
			if m.Evicted != nil {
				m.Evicted(k, v)
			}
			return true
		}
	}
	return false
}

// Delete removes k.
func (m *Map[K, V]) Delete(k K) { delete(m.m, k) }

// Len is the number of entries.
func (m *Map[K, V]) Len() int { return len(m.m) }

// All yields every entry (Put and Delete must not be called meanwhile).
func (m *Map[K, V]) All() iter.Seq2[K, V] {
	return func(yield func(K, V) bool) {
		for k, v := range m.m {
			if !yield(k, v) {
				return
			}
		}
	}
}
