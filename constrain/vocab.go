package constrain

import "sort"

// Vocab is a tokenizer's vocabulary as a trie of token bytes, so the
// allowed tokens of a step are found in one walk that shares the
// automaton's work over common prefixes and drops a subtree at its first
// refused byte.
type Vocab struct {
	root   trie
	tokens [][]byte
	eos    map[int32]bool
}

type trie struct {
	ids   []int32 // tokens whose bytes end here
	bytes []byte  // child labels, sorted
	kids  []*trie
}

// NewVocab builds the trie: tokens[id] is the bytes token id decodes to
// (nil or empty: never allowed, as special tokens), eos the tokens that end
// a generation.
func NewVocab(tokens [][]byte, eos []int32) *Vocab {
	v := &Vocab{tokens: tokens, eos: map[int32]bool{}}
	for _, id := range eos {
		v.eos[id] = true
	}
	for id, b := range tokens {
		if len(b) == 0 || v.eos[int32(id)] {
			continue
		}
		t := &v.root
		for _, c := range b {
			i := sort.Search(len(t.bytes), func(i int) bool { return t.bytes[i] >= c })
			if i == len(t.bytes) || t.bytes[i] != c {
				t.bytes = append(t.bytes[:i], append([]byte{c}, t.bytes[i:]...)...)
				t.kids = append(t.kids[:i], append([]*trie{{}}, t.kids[i:]...)...)
			}
			t = t.kids[i]
		}
		t.ids = append(t.ids, int32(id))
	}
	return v
}

// Size is the number of token ids.
func (v *Vocab) Size() int { return len(v.tokens) }

// Allowed sets allowed[id] for every token that may come next in state s
// (len(allowed) must be the vocabulary size) and returns how many. The end
// tokens are allowed exactly when the document may end. With budget >= 0
// only tokens after which the document can close in budget bytes are
// allowed (see Cost).
func (v *Vocab) Allowed(s *State, allowed []bool, budget int) int {
	clear(allowed)
	n := 0
	if s.CanEnd() {
		for id := range v.eos {
			if int(id) < len(allowed) {
				allowed[id] = true
				n++
			}
		}
	}
	if s.Done() {
		return n
	}
	// One reusable state per trie depth: the walk allocates nothing per node.
	levels := make([]State, 0, 64)
	var walk func(t *trie, st *State, depth int)
	walk = func(t *trie, st *State, depth int) {
		if depth == len(levels) {
			levels = append(levels, State{})
		}
		for i, c := range t.bytes {
			next := &levels[depth]
			next.copyFrom(st)
			if !next.Step(c) {
				continue
			}
			k := t.kids[i]
			if len(k.ids) > 0 && (budget < 0 || next.Cost() <= budget) {
				for _, id := range k.ids {
					allowed[id] = true
				}
				n += len(k.ids)
			}
			if len(k.bytes) > 0 {
				walk(k, next, depth+1)
			}
		}
	}
	walk(&v.root, s, 0)
	return n
}

// Replay steps st over the bytes of ids (what was generated so far); false
// when they do not fit the schema. An end token must be last.
func (v *Vocab) Replay(st *State, ids []int32) bool {
	for i, id := range ids {
		if v.eos[id] {
			return i == len(ids)-1 && st.CanEnd()
		}
		if int(id) < 0 || int(id) >= len(v.tokens) || len(v.tokens[id]) == 0 {
			return false
		}
		for _, c := range v.tokens[id] {
			if !st.Step(c) {
				return false
			}
		}
	}
	return true
}
