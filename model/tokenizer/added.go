package tokenizer

import (
	"unicode"
	"unicode/utf8"
)

// addedToken is an entry of added_tokens: split out of the text before the
// model sees it.
type addedToken struct {
	id         int32
	content    string
	singleWord bool
	lstrip     bool
	rstrip     bool
	normalized bool
	special    bool
}

// matcher finds added tokens leftmost-longest, like the Aho-Corasick
// automaton Hugging Face uses, with a byte trie walked from each position.
type matcher struct {
	nodes []trieNode
	first [256]bool // bytes some token starts with: a cheap pre-check
}

type trieNode struct {
	next map[byte]int32
	tok  int32 // index into tokens, -1 when no token ends here
}

func newMatcher(contents []string) *matcher {
	m := &matcher{nodes: []trieNode{{tok: -1}}}
	for i, c := range contents {
		if c == "" {
			continue
		}
		m.first[c[0]] = true
		n := int32(0)
		for j := 0; j < len(c); j++ {
			nx, ok := m.nodes[n].next[c[j]]
			if !ok {
				if m.nodes[n].next == nil {
					m.nodes[n].next = make(map[byte]int32)
				}
				nx = int32(len(m.nodes))
				m.nodes = append(m.nodes, trieNode{tok: -1})
				m.nodes[n].next[c[j]] = nx
			}
			n = nx
		}
		if m.nodes[n].tok == -1 {
			m.nodes[n].tok = int32(i)
		}
	}
	return m
}

func (m *matcher) empty() bool { return m == nil || len(m.nodes[0].next) == 0 }

// longestAt returns the token index and length of the longest match
// starting at s[i:], or -1.
func (m *matcher) longestAt(s string, i int) (tok, n int) {
	tok, n = -1, 0
	node := int32(0)
	for j := i; j < len(s); j++ {
		nx, ok := m.nodes[node].next[s[j]]
		if !ok {
			break
		}
		node = nx
		if t := m.nodes[node].tok; t >= 0 {
			tok, n = int(t), j+1-i
		}
	}
	return tok, n
}

// segment is a piece of text, or an added token when tok >= 0.
type segment struct {
	text    string
	tok     int32
	atStart bool // begins at offset 0 of the original text
}

// splitAdded cuts s around the added tokens tokens[...] found by m,
// applying single_word, lstrip and rstrip as Hugging Face does.
func splitAdded(s string, atStart bool, m *matcher, tokens []addedToken, out []segment) []segment {
	if m.empty() {
		if s == "" { // HF drops empty splits; Metaspace would prepend to one
			return out
		}
		return append(out, segment{text: s, tok: -1, atStart: atStart})
	}
	done := 0 // s[:done] is already emitted
	for i := 0; i < len(s); {
		if !m.first[s[i]] {
			i++
			continue
		}
		ti, n := m.longestAt(s, i)
		if ti < 0 {
			i++
			continue
		}
		t := &tokens[ti]
		start, stop := i, i+n
		if t.singleWord && (endsWithWord(s[:start]) || startsWithWord(s[stop:])) {
			i = stop // the automaton resumes after a rejected match
			continue
		}
		if t.lstrip {
			start = max(done, start-trailingSpace(s[:start]))
		}
		if t.rstrip {
			stop += leadingSpace(s[stop:])
		}
		if done < start {
			out = append(out, segment{text: s[done:start], tok: -1, atStart: atStart && done == 0})
		}
		out = append(out, segment{tok: t.id})
		done, i = stop, stop
	}
	if done < len(s) {
		out = append(out, segment{text: s[done:], tok: -1, atStart: atStart && done == 0})
	}
	return out
}

func isWordRune(r rune) bool {
	return r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.IsMark(r)
}

func endsWithWord(s string) bool {
	r, n := utf8.DecodeLastRuneInString(s)
	return n > 0 && isWordRune(r)
}

func startsWithWord(s string) bool {
	r, n := utf8.DecodeRuneInString(s)
	return n > 0 && isWordRune(r)
}

// trailingSpace is the byte length of the whitespace run ending s.
func trailingSpace(s string) int {
	n := 0
	for n < len(s) {
		r, w := utf8.DecodeLastRuneInString(s[:len(s)-n])
		if !unicode.IsSpace(r) {
			break
		}
		n += w
	}
	return n
}

// leadingSpace is the byte length of the whitespace run starting s.
func leadingSpace(s string) int {
	n := 0
	for n < len(s) {
		r, w := utf8.DecodeRuneInString(s[n:])
		if !unicode.IsSpace(r) {
			break
		}
		n += w
	}
	return n
}
