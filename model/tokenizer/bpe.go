package tokenizer

import (
	"container/heap"
	"fmt"
	"sync"
	"unicode/utf8"
)

// bpe is the BPE model: vocab, merge ranks, and the unknown/byte-fallback
// rules for characters the vocab lacks.
type bpe struct {
	vocab        map[string]int32
	merges       map[uint64]mergeRule // key: left<<32 | right
	unk          int32                // -1 when there is no unk token
	fuseUnk      bool
	byteFallback bool
	byteTokens   [256]int32 // <0xNN> ids, -1 when absent
	ignoreMerges bool

	// byteSymbols maps each byte straight to its id when every byte has a
	// single-character token (byte-level vocabularies): a fast path that
	// skips per-rune map lookups. Nil otherwise.
	byteSymbols *[256]int32
	byteLevel   bool // words are byte-level alphabet strings

	cache wordCache
}

type mergeRule struct {
	rank int32
	id   int32
}

// newBPE builds the model from its spec and merge list. ranks[i] is the
// priority of merges[i], lower first (pairs of equal rank merge leftmost
// first); nil ranks mean list order.
func newBPE(m *modelSpec, merges [][2]string, ranks []int32) (*bpe, error) {
	if m.Type != "" && m.Type != "BPE" {
		return nil, fmt.Errorf("model type %q is not supported (only BPE)", m.Type)
	}
	if m.Vocab == nil {
		return nil, fmt.Errorf("model.vocab is missing")
	}
	if p := m.ContinuingSubwordPrefix; p != nil && *p != "" {
		return nil, fmt.Errorf("model.continuing_subword_prefix %q is not supported", *p)
	}
	if s := m.EndOfWordSuffix; s != nil && *s != "" {
		return nil, fmt.Errorf("model.end_of_word_suffix %q is not supported", *s)
	}
	b := &bpe{
		vocab:        make(map[string]int32, len(m.Vocab)),
		unk:          -1,
		fuseUnk:      m.FuseUnk,
		byteFallback: m.ByteFallback,
		ignoreMerges: m.IgnoreMerges,
	}
	owner := make(map[int64]string, len(m.Vocab))
	for tok, id := range m.Vocab {
		if id < 0 || id >= maxTokenID {
			return nil, fmt.Errorf("model.vocab: token %q has id %d outside [0, %d)", tok, id, maxTokenID)
		}
		if other, dup := owner[id]; dup {
			// Sorted names keep the message the same from run to run.
			return nil, fmt.Errorf("model.vocab: id %d is given to both %q and %q", id, min(other, tok), max(other, tok))
		}
		owner[id] = tok
		b.vocab[tok] = int32(id)
	}
	if m.UnkToken != nil && *m.UnkToken != "" {
		id, ok := b.vocab[*m.UnkToken]
		if !ok {
			return nil, fmt.Errorf("model.unk_token %q is not in the vocab", *m.UnkToken)
		}
		b.unk = id
	}
	for i := range b.byteTokens {
		b.byteTokens[i] = -1
		if id, ok := b.vocab[fmt.Sprintf("<0x%02X>", i)]; ok {
			b.byteTokens[i] = id
		}
	}
	if ranks != nil && len(ranks) != len(merges) {
		return nil, fmt.Errorf("%d merge ranks for %d merges", len(ranks), len(merges))
	}
	b.merges = make(map[uint64]mergeRule, len(merges))
	for i, mg := range merges {
		l, ok1 := b.vocab[mg[0]]
		r, ok2 := b.vocab[mg[1]]
		if !ok1 || !ok2 {
			missing := mg[0]
			if ok1 {
				missing = mg[1]
			}
			return nil, fmt.Errorf("model.merges[%d] %q %q: token %q is not in the vocab", i, mg[0], mg[1], missing)
		}
		id, ok := b.vocab[mg[0]+mg[1]]
		if !ok {
			return nil, fmt.Errorf("model.merges[%d]: merged token %q is not in the vocab", i, mg[0]+mg[1])
		}
		rank := int32(i)
		if ranks != nil {
			rank = ranks[i]
		}
		key := uint64(uint32(l))<<32 | uint64(uint32(r))
		if old, dup := b.merges[key]; !dup || rank < old.rank { // the lowest rank wins
			b.merges[key] = mergeRule{rank: rank, id: id}
		}
	}
	return b, nil
}

// enableByteLevel turns on the byte-level fast path when every byte's
// alphabet character is a token.
func (b *bpe) enableByteLevel() {
	b.byteLevel = true
	var tab [256]int32
	for i := 0; i < 256; i++ {
		id, ok := b.vocab[string(byteToRune[i])]
		if !ok {
			return
		}
		tab[i] = id
	}
	b.byteSymbols = &tab
}

// encodeWord appends the ids of one pre-tokenized word. For byte-level
// models w holds raw bytes, which map one-to-one to the alphabet form the
// vocab is written in, so raw bytes serve as the cache key.
func (b *bpe) encodeWord(dst []int32, w string) []int32 {
	if w == "" {
		return dst
	}
	if ids, ok := b.cache.get(w); ok {
		return append(dst, ids...)
	}
	if b.ignoreMerges {
		key := w
		if b.byteLevel {
			key = ByteLevel(w)
		}
		if id, ok := b.vocab[key]; ok {
			b.cache.put(w, []int32{id})
			return append(dst, id)
		}
	}
	var syms []symbol
	switch {
	case b.byteSymbols != nil:
		syms = make([]symbol, len(w))
		for i := 0; i < len(w); i++ {
			syms[i].id = b.byteSymbols[w[i]]
		}
	case b.byteLevel:
		syms = b.initialSymbols(ByteLevel(w))
	default:
		syms = b.initialSymbols(w)
	}
	syms = b.mergeAll(syms)
	start := len(dst)
	for i := 0; i >= 0 && i < len(syms); i = syms[i].next {
		dst = append(dst, syms[i].id)
		if syms[i].next == -1 {
			break
		}
	}
	b.cache.put(w, dst[start:])
	return dst
}

// symbol is one node of the doubly linked list BPE merges over.
type symbol struct {
	id         int32
	prev, next int
	gone       bool
}

// initialSymbols splits a word into per-character tokens, using byte
// fallback and then unk for characters the vocab lacks.
func (b *bpe) initialSymbols(word string) []symbol {
	syms := make([]symbol, 0, len(word))
	pendingUnk := false
	flushUnk := func() {
		if pendingUnk {
			syms = append(syms, symbol{id: b.unk})
			pendingUnk = false
		}
	}
	for i := 0; i < len(word); {
		_, n := utf8.DecodeRuneInString(word[i:])
		ch := word[i : i+n]
		i += n
		if id, ok := b.vocab[ch]; ok {
			flushUnk()
			syms = append(syms, symbol{id: id})
			continue
		}
		if b.byteFallback {
			all := true
			for j := 0; j < len(ch); j++ {
				if b.byteTokens[ch[j]] < 0 {
					all = false
					break
				}
			}
			if all {
				flushUnk()
				for j := 0; j < len(ch); j++ {
					syms = append(syms, symbol{id: b.byteTokens[ch[j]]})
				}
				continue
			}
		}
		if b.unk >= 0 {
			if pendingUnk && !b.fuseUnk {
				flushUnk()
			}
			pendingUnk = true
		}
		// Without an unk token the character is dropped, as HF does.
	}
	flushUnk()
	return syms
}

// mergeAll applies merges lowest rank first, leftmost first among equal
// ranks, the order Hugging Face tokenizers uses.
func (b *bpe) mergeAll(syms []symbol) []symbol {
	for i := range syms {
		syms[i].prev = i - 1
		syms[i].next = i + 1
	}
	if len(syms) > 0 {
		syms[len(syms)-1].next = -1
	}
	if len(syms) < 2 || len(b.merges) == 0 {
		return syms
	}
	q := make(mergeQueue, 0, len(syms))
	for i := 0; i+1 < len(syms); i++ {
		if r, ok := b.merges[pairKey(syms[i].id, syms[i+1].id)]; ok {
			q = append(q, candidate{pos: i, rank: r.rank, id: r.id})
		}
	}
	heap.Init(&q)
	for q.Len() > 0 {
		c := heap.Pop(&q).(candidate)
		left := &syms[c.pos]
		if left.gone || left.next == -1 {
			continue
		}
		right := &syms[left.next]
		// Skip entries made stale by an earlier merge.
		if r, ok := b.merges[pairKey(left.id, right.id)]; !ok || r.id != c.id {
			continue
		}
		left.id = c.id
		right.gone = true
		left.next = right.next
		if left.next != -1 {
			syms[left.next].prev = c.pos
		}
		if left.prev != -1 {
			p := left.prev
			if r, ok := b.merges[pairKey(syms[p].id, left.id)]; ok {
				heap.Push(&q, candidate{pos: p, rank: r.rank, id: r.id})
			}
		}
		if left.next != -1 {
			if r, ok := b.merges[pairKey(left.id, syms[left.next].id)]; ok {
				heap.Push(&q, candidate{pos: c.pos, rank: r.rank, id: r.id})
			}
		}
	}
	return syms
}

func pairKey(l, r int32) uint64 { return uint64(uint32(l))<<32 | uint64(uint32(r)) }

type candidate struct {
	pos  int
	rank int32
	id   int32
}

type mergeQueue []candidate

func (q mergeQueue) Len() int { return len(q) }
func (q mergeQueue) Less(i, j int) bool {
	if q[i].rank != q[j].rank {
		return q[i].rank < q[j].rank
	}
	return q[i].pos < q[j].pos
}
func (q mergeQueue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *mergeQueue) Push(x any)   { *q = append(*q, x.(candidate)) }
func (q *mergeQueue) Pop() any {
	old := *q
	c := old[len(old)-1]
	*q = old[:len(old)-1]
	return c
}

// wordCache remembers the ids of short words; BPE on common words
// (keywords, indentation) dominates encoding time otherwise. Bounded: it is
// cleared when full, which keeps memory flat under hostile input.
type wordCache struct {
	mu sync.RWMutex
	m  map[string][]int32
}

const (
	cacheMaxEntries = 1 << 16
	cacheMaxWordLen = 64
)

func (c *wordCache) get(w string) ([]int32, bool) {
	if len(w) > cacheMaxWordLen {
		return nil, false
	}
	c.mu.RLock()
	ids, ok := c.m[w]
	c.mu.RUnlock()
	return ids, ok
}

func (c *wordCache) put(w string, ids []int32) {
	if len(w) > cacheMaxWordLen {
		return
	}
	cp := append([]int32(nil), ids...)
	c.mu.Lock()
	if c.m == nil || len(c.m) >= cacheMaxEntries {
		c.m = make(map[string][]int32)
	}
	c.m[w] = cp
	c.mu.Unlock()
}
