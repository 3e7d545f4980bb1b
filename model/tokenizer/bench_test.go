package tokenizer

import (
	"strings"
	"testing"
)

// benchText is Go source like the text gocoder is trained on, with a few
// non-ASCII strings.
var benchText = strings.Repeat(`// Package cache keeps recently used values.
package cache

import (
	"container/list"
	"fmt"
	"sync"
)

// LRU is a least-recently-used cache; safe for concurrent use.
type LRU struct {
	mu    sync.Mutex
	max   int
	ll    *list.List
	items map[string]*list.Element
}

type entry struct {
	key   string
	value any
}

// New returns a cache holding at most max entries.
func New(max int) (*LRU, error) {
	if max <= 0 {
		return nil, fmt.Errorf("cache: max %d must be positive (größer als 0, 最大値)", max)
	}
	return &LRU{max: max, ll: list.New(), items: make(map[string]*list.Element)}, nil
}

// Get returns the value for key and marks it used.
func (c *LRU) Get(key string) (any, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.items[key]; ok {
		c.ll.MoveToFront(e)
		return e.Value.(*entry).value, true
	}
	return nil, false
}
`, 4)

// BenchmarkEncode reports MB/s on ~4 KB of Go source. The word cache is
// warm after the first iteration, as it is in a server.
func BenchmarkEncode(b *testing.B) {
	tok, _ := goCoderCases(b)
	b.SetBytes(int64(len(benchText)))
	b.ReportAllocs()
	for b.Loop() {
		tok.Encode(benchText, true)
	}
}

// BenchmarkEncodeCold is Encode with the word cache cleared every time:
// the cost of text never seen before.
func BenchmarkEncodeCold(b *testing.B) {
	tok, _ := goCoderCases(b)
	b.SetBytes(int64(len(benchText)))
	for b.Loop() {
		tok.model.cache.mu.Lock()
		tok.model.cache.m = nil
		tok.model.cache.mu.Unlock()
		tok.Encode(benchText, true)
	}
}

// BenchmarkDecode reports MB/s of decoded text.
func BenchmarkDecode(b *testing.B) {
	tok, _ := goCoderCases(b)
	ids := tok.Encode(benchText, false)
	b.SetBytes(int64(len(benchText)))
	for b.Loop() {
		tok.Decode(ids, false)
	}
}

// BenchmarkEncodeRegexp2 is the baseline for BenchmarkEncode: the same
// tokenizer splitting with regexp2 instead of the hand-written splitter.
func BenchmarkEncodeRegexp2(b *testing.B) {
	useFastSplit = false
	defer func() { useFastSplit = true }()
	tok, _ := goCoderCases(b)
	b.SetBytes(int64(len(benchText)))
	b.ReportAllocs()
	for b.Loop() {
		tok.Encode(benchText, true)
	}
}
