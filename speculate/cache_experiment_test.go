package speculate

import (
	"container/list"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"meshgpu/engine"
	"meshgpu/internal/testenv"
	"meshgpu/native"
)

// The experiment's node-wide n-gram cache (issue 28): an instrument for
// TestCacheExperiment, not wired into the node, because the experiment found
// it adds too little (docs/performance.md, "A node-wide n-gram cache").

// cacheMaxN is the longest n-gram the cache counts.
const cacheMaxN = 4

// cacheNexts is how many distinct next tokens an entry counts; a new one
// replaces the least counted (an n-gram followed by many tokens predicts
// none of them well).
const cacheNexts = 4

// gram is an n-gram of 1 to cacheMaxN tokens (the unused tail is zero).
type gram struct {
	n   uint8
	ids [cacheMaxN]int32
}

type nextCount struct {
	id    int32
	count uint32
}

type cacheEntry struct {
	key   gram
	nexts [cacheNexts]nextCount // most counted first; count 0: unused
	elem  *list.Element
}

// ngramCache is a node-wide n-gram cache: for every 1- to cacheMaxN-gram of the
// generations fed to it, the counts of the tokens that followed, so that
// drafting for a new generation can continue phrases earlier generations
// wrote (prompt lookup sees only its own generation's text). It holds at
// most a fixed number of entries, evicting the least recently fed or used
// one, and is safe for concurrent use. Its answers depend only on the
// sequence of calls made to it.
type ngramCache struct {
	mu      sync.Mutex
	max     int
	entries map[gram]*cacheEntry
	lru     *list.List // of *cacheEntry, most recent at the front
}

// newNGramCache is a cache of at most maxEntries n-grams (at least 1).
func newNGramCache(maxEntries int) *ngramCache {
	return &ngramCache{max: max(maxEntries, 1), entries: make(map[gram]*cacheEntry), lru: list.New()}
}

func gramOf(ids []int32) gram {
	g := gram{n: uint8(len(ids))}
	copy(g.ids[:], ids)
	return g
}

// Feed counts the n-grams of tokens (one generation's prompt and output)
// and the token after each.
func (c *ngramCache) Feed(tokens []int32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := 1; i < len(tokens); i++ {
		for n := 1; n <= cacheMaxN && n <= i; n++ {
			c.count(gramOf(tokens[i-n:i]), tokens[i])
		}
	}
}

func (c *ngramCache) count(g gram, next int32) {
	e := c.entries[g]
	if e == nil {
		if len(c.entries) >= c.max {
			old := c.lru.Remove(c.lru.Back()).(*cacheEntry)
			delete(c.entries, old.key)
		}
		e = &cacheEntry{key: g}
		e.elem = c.lru.PushFront(e)
		c.entries[g] = e
	} else {
		c.lru.MoveToFront(e.elem)
	}
	at := -1
	for i := range e.nexts {
		if e.nexts[i].count > 0 && e.nexts[i].id == next {
			at = i
			break
		}
	}
	if at < 0 { // replace the least counted (the last)
		at = cacheNexts - 1
		e.nexts[at] = nextCount{id: next}
	}
	if e.nexts[at].count < ^uint32(0) {
		e.nexts[at].count++
	}
	// keep most counted first; among equals the earlier counted stays first
	for at > 0 && e.nexts[at].count > e.nexts[at-1].count {
		e.nexts[at], e.nexts[at-1] = e.nexts[at-1], e.nexts[at]
		at--
	}
}

// Len is the number of entries.
func (c *ngramCache) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.entries)
}

// Propose drafts up to k tokens after history: the most counted next token
// of the longest suffix (of history and the drafts so far) of at least
// minN tokens the cache knows, one token at a time.
func (c *ngramCache) Propose(history []int32, k, minN int) []int32 {
	minN = max(minN, 1)
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []int32
	tail := make([]int32, 0, cacheMaxN+k)
	tail = append(tail, history[max(len(history)-cacheMaxN, 0):]...)
	for len(out) < k {
		id, ok := c.next(tail, minN)
		if !ok {
			break
		}
		out = append(out, id)
		tail = append(tail, id)
	}
	return out
}

// next is the most counted token after the longest known suffix of tail.
func (c *ngramCache) next(tail []int32, minN int) (int32, bool) {
	for n := min(cacheMaxN, len(tail)); n >= minN; n-- {
		if e := c.entries[gramOf(tail[len(tail)-n:])]; e != nil {
			c.lru.MoveToFront(e.elem)
			return e.nexts[0].id, true
		}
	}
	return 0, false
}

// cachedNGram is prompt lookup (NGram) that falls back on a node-wide
// ngramCache where the generation's own text has no match.
type cachedNGram struct {
	NGram
	Cache *ngramCache
	MinN  int // the shortest suffix the cache answers for; default 1
}

// Propose implements Drafter.
func (g cachedNGram) Propose(ctx context.Context, history []int32, k int) ([]int32, error) {
	d, err := g.NGram.Propose(ctx, history, k)
	if len(d) > 0 || err != nil || g.Cache == nil || k <= 0 {
		return d, err
	}
	return g.Cache.Propose(history, k, g.MinN), nil
}

// The instrument is right: it continues what it was fed, longest suffix
// first, most counted next token first, and holds at most its bound.
func TestNGramCacheInstrument(t *testing.T) {
	c := newNGramCache(1000)
	c.Feed([]int32{1, 2, 3, 4, 5})
	c.Feed([]int32{9, 3, 7, 3, 7})
	if got := c.Propose([]int32{8, 2, 3}, 3, 1); !slices.Equal(got, []int32{4, 5}) {
		t.Errorf("after 2 3: %v, want [4 5] (the 2-gram 2 3 beats the 1-gram 3)", got)
	}
	if got := c.Propose([]int32{8, 3}, 1, 1); !slices.Equal(got, []int32{7}) {
		t.Errorf("after 3: %v, want 7 (counted twice, 4 once)", got)
	}
	if got := c.Propose([]int32{8, 3}, 1, 2); got != nil {
		t.Errorf("minN 2 after the unknown 8 3: %v", got)
	}
	small := newNGramCache(3)
	small.Feed([]int32{1, 2, 3, 4, 5, 6})
	if small.Len() != 3 {
		t.Errorf("a 3-entry cache holds %d", small.Len())
	}
	// the last position's longer n-grams are the most recently fed
	if got := small.Propose([]int32{3, 4, 5}, 1, 1); !slices.Equal(got, []int32{6}) {
		t.Errorf("the most recent n-grams were evicted: %v", got)
	}
	if got := small.Propose([]int32{9, 1}, 1, 1); got != nil {
		t.Errorf("the oldest n-gram survived a full cache: %v", got)
	}
}

// drafterFunc adapts a function to Drafter.
type drafterFunc func(history []int32, k int) []int32

func (f drafterFunc) Propose(_ context.Context, h []int32, k int) ([]int32, error) {
	return f(h, k), nil
}
func (drafterFunc) Close() {}

// simStats is what simulate counts.
type simStats struct {
	passes, empty int // passes, and those that carried no draft
	// passes whose draft came from elsewhere than prompt lookup (which had
	// none), and their accepted drafts
	other, otherAccepted int
}

// simulate counts the passes speculative decoding with d and k drafts a
// pass needs for the greedy output out after prompt (the first output token
// comes from the prompt's pass).
func simulate(d Drafter, prompt, out []int32, k int) simStats {
	var s simStats
	for p := 1; p < len(out); {
		hist := append(slices.Clone(prompt), out[:p]...)
		drafts, _ := d.Propose(context.Background(), hist, k)
		lookup, _ := NGram{}.Propose(context.Background(), hist, k)
		if b, ok := d.(bothDrafter); ok {
			drafts = lookup
			if c := b.c.Propose(hist, k, 1); common(c, out[p:]) > common(drafts, out[p:]) {
				drafts = c
			}
		}
		acc := common(drafts, out[p:])
		if len(drafts) == 0 {
			s.empty++
		} else if len(lookup) == 0 {
			s.other++
			s.otherAccepted += acc
		}
		s.passes++
		p += acc + 1
	}
	return s
}

// contextMatch is the longest suffix of h (up to 4) that occurs earlier in h.
func contextMatch(h []int32) int {
	for n := min(4, len(h)-1); n >= 1; n-- {
		for s := len(h) - n - 1; s >= 0; s-- {
			if slices.Equal(h[s:s+n], h[len(h)-n:]) {
				return n
			}
		}
	}
	return 0
}

// cacheMatch is the longest suffix of h the cache knows.
func cacheMatch(c *ngramCache, h []int32) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for n := min(cacheMaxN, len(h)); n >= 1; n-- {
		if c.entries[gramOf(h[len(h)-n:])] != nil {
			return n
		}
	}
	return 0
}

// bothDrafter stands for a tree of the context's and the cache's drafts:
// simulate compares one draft, so it peeks at the answer (out) to return
// the branch a tree pass would accept. Only an upper bound.
type bothDrafter struct {
	c   *ngramCache
	out []int32 // set by simulateBoth
}

func (bothDrafter) Propose(context.Context, []int32, int) ([]int32, error) { return nil, nil }
func (bothDrafter) Close()                                                 {}

func common(a, b []int32) int {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	return i
}

// warmCorpus is Go code written for this experiment, in no prompt file or
// test: a static warm-up for the cache (idioms, not the bench's texts).
var warmCorpus = []string{
	"func openConfig(name string) (*Config, error) {\n\tf, err := os.Open(name)\n\tif err != nil {\n\t\treturn nil, err\n\t}\n\tdefer f.Close()\n\tvar c Config\n\tif err := json.NewDecoder(f).Decode(&c); err != nil {\n\t\treturn nil, fmt.Errorf(\"%s: %w\", name, err)\n\t}\n\treturn &c, nil\n}\n",
	"type Queue struct {\n\tmu    sync.Mutex\n\titems []int\n}\n\n// Len returns the number of items.\nfunc (q *Queue) Len() int {\n\tq.mu.Lock()\n\tdefer q.mu.Unlock()\n\treturn len(q.items)\n}\n",
	"func TestSum(t *testing.T) {\n\tfor _, tc := range []struct {\n\t\tname string\n\t\tin   []int\n\t\twant int\n\t}{\n\t\t{\"empty\", nil, 0},\n\t\t{\"one\", []int{1}, 1},\n\t} {\n\t\tif got := Sum(tc.in); got != tc.want {\n\t\t\tt.Errorf(\"%s: Sum = %d, want %d\", tc.name, got, tc.want)\n\t\t}\n\t}\n}\n",
	"func serve(w http.ResponseWriter, r *http.Request) {\n\tif r.Method != http.MethodGet {\n\t\thttp.Error(w, \"method not allowed\", http.StatusMethodNotAllowed)\n\t\treturn\n\t}\n\tw.Header().Set(\"Content-Type\", \"application/json\")\n\tjson.NewEncoder(w).Encode(map[string]string{\"status\": \"ok\"})\n}\n",
	"func countWords(r io.Reader) (map[string]int, error) {\n\tcounts := make(map[string]int)\n\tsc := bufio.NewScanner(r)\n\tsc.Split(bufio.ScanWords)\n\tfor sc.Scan() {\n\t\tcounts[strings.ToLower(sc.Text())]++\n\t}\n\treturn counts, sc.Err()\n}\n",
}

// TestCacheExperiment measures, on the greedy outputs of the bench's WAN
// prompts in order, the tokens per pass prompt lookup gets alone and with a
// node-wide cache fed only with the earlier prompts' prompts and outputs
// (never the current one's), and with a warm-up corpus too. It is an
// experiment: it logs the numbers (docs/performance.md), and fails only
// if the cache makes drafting worse.
func TestCacheExperiment(t *testing.T) {
	if testing.Short() {
		t.Skip("generates 6 x 96 tokens")
	}
	raw, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "bench/testdata/wan-prompts.json"))
	if err != nil {
		t.Fatal(err)
	}
	var texts []string
	if err := json.Unmarshal(raw, &texts); err != nil {
		t.Fatal(err)
	}
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	m, err := engine.Load(testenv.GoCoder(t), engine.Options{Backend: be, Last: -1, MaxContext: 1024})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	const n = 96
	prompts, outs := make([][]int32, len(texts)), make([][]int32, len(texts))
	for i, text := range texts {
		prompts[i] = m.Tokenizer.Encode(text, true)
		r, err := m.Generate(context.Background(), prompts[i], engine.GenerateParams{MaxTokens: n, IgnoreEOS: true}, nil)
		if err != nil {
			t.Fatal(err)
		}
		outs[i] = r.IDs
	}
	type variant struct {
		name string
		warm bool
		make func(c *ngramCache) Drafter
	}
	variants := []variant{
		{"context", false, func(*ngramCache) Drafter { return NGram{} }},
		{"context+cache", false, func(c *ngramCache) Drafter { return cachedNGram{Cache: c} }},
		{"context+cache(min2)", false, func(c *ngramCache) Drafter { return cachedNGram{Cache: c, MinN: 2} }},
		{"context+cache+warm", true, func(c *ngramCache) Drafter { return cachedNGram{Cache: c} }},
		// the draft whose suffix match is longer (context on ties)
		{"longest-match", false, func(c *ngramCache) Drafter {
			return drafterFunc(func(h []int32, k int) []int32 {
				if contextMatch(h) >= cacheMatch(c, h) {
					d, _ := NGram{}.Propose(context.Background(), h, k)
					return d
				}
				return c.Propose(h, k, 1)
			})
		}},
		// an upper bound for a two-branch tree: the better of both drafts
		{"both-branches(oracle)", false, func(c *ngramCache) Drafter { return bothDrafter{c: c} }},
	}
	for _, k := range []int{4, 8} {
		var base float64
		for _, v := range variants {
			c := newNGramCache(1 << 16)
			if v.warm {
				for _, w := range warmCorpus {
					c.Feed(m.Tokenizer.Encode(w, true))
				}
			}
			var toks, passes, empty, other, otherAcc int
			var per []string
			for i := range prompts {
				s := simulate(v.make(c), prompts[i], outs[i], k)
				per = append(per, fmt.Sprintf("%.2f", float64(len(outs[i])-1)/float64(s.passes)))
				toks, passes, empty = toks+len(outs[i])-1, passes+s.passes, empty+s.empty
				other, otherAcc = other+s.other, otherAcc+s.otherAccepted
				c.Feed(append(slices.Clone(prompts[i]), outs[i]...)) // for the later prompts only
			}
			tpp := float64(toks) / float64(passes)
			if v.name == "context" {
				base = tpp
			}
			t.Logf("k=%d %-22s tokens/pass %.2f (%.2fx), of passes with drafts %.2f; passes without a draft %d/%d; drafts where lookup had none: %d passes, %d accepted; per prompt %v",
				k, v.name, tpp, tpp/base, float64(toks-empty)/float64(passes-empty), empty, passes, other, otherAcc, per)
			if tpp < base*0.95 {
				t.Errorf("k=%d %s: %.2f tokens per pass, below context lookup's %.2f", k, v.name, tpp, base)
			}
		}
	}
}
