package boundmap

import "testing"

// A full map evicts exactly one entry its policy allows for each new key,
// keeps the others, and refuses a new key when none may go.
func TestPutEvictsOneAllowedEntry(t *testing.T) {
	var evicted []int
	m := Map[int, bool]{Max: 4, Evictable: func(_ int, pinned bool) bool { return !pinned },
		Evicted: func(k int, _ bool) { evicted = append(evicted, k) }}
	for k, pinned := range []bool{true, false, true, false} {
		if !m.Put(k, pinned) {
			t.Fatalf("Put(%d) into a map with room refused", k)
		}
	}
	if !m.Put(2, true) || m.Len() != 4 || len(evicted) != 0 {
		t.Fatalf("replacing a key evicted %v, len %d", evicted, m.Len())
	}
	if !m.Put(10, true) || m.Len() != 4 || len(evicted) != 1 || (evicted[0] != 1 && evicted[0] != 3) {
		t.Fatalf("a new key in a full map: evicted %v, len %d; want one of 1, 3", evicted, m.Len())
	}
	if !m.Put(11, true) || len(evicted) != 2 || evicted[0] == evicted[1] {
		t.Fatalf("the second new key: evicted %v", evicted)
	}
	if m.Put(12, false) {
		t.Fatal("a new key stored though every entry is pinned")
	}
	if _, ok := m.Get(12); ok || m.Len() != 4 {
		t.Fatalf("a refused key is stored, len %d", m.Len())
	}
	for _, k := range []int{0, 2, 10, 11} {
		if _, ok := m.Get(k); !ok {
			t.Fatalf("pinned key %d evicted", k)
		}
	}
	m.Delete(0)
	if !m.Put(12, false) {
		t.Fatal("a new key refused after a Delete made room")
	}
	any := Map[string, int]{Max: 1}
	any.Put("a", 1)
	if !any.Put("b", 2) || any.Len() != 1 {
		t.Fatal("with no policy, any entry may go")
	}
}
