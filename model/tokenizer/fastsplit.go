package tokenizer

import (
	"unicode"
	"unicode/utf8"
)

// Hand-written equivalents of the split regexes of Llama 3 (and gocoder),
// Qwen2 and GPT-2 (ByteLevel's use_regex, SmolLM2). regexp2 allocates a Match per pre-token and backtracks
// through the alternatives; scanning the alternatives directly is several
// times faster (BenchmarkEncode vs BenchmarkEncodeRegexp2), and
// TestFastSplitMatchesRegex / FuzzFastSplit hold the two to the same
// output.
const (
	llama3Pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	qwen2Pattern  = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
)

// fastSplitter returns the hand-written splitter for a known pattern used
// with behavior Isolated, or nil.
func fastSplitter(pattern string) preTokenizer {
	var next func(s string, i int) int
	switch pattern {
	case llama3Pattern:
		next = func(s string, i int) int { return llama3Next(s, i, 3) }
	case qwen2Pattern:
		next = func(s string, i int) int { return llama3Next(s, i, 1) }
	case gpt2Pattern:
		next = gpt2Next
	default:
		return nil
	}
	return func(in []piece) []piece {
		out := make([]piece, 0, len(in)*8)
		for _, p := range in {
			s := p.text
			for i := 0; i < len(s); {
				j := next(s, i)
				out = append(out, piece{s[i:j], p.atStart && i == 0})
				i = j
			}
		}
		return out
	}
}

type charClass uint8

const (
	classOther charClass = iota // [^\s\p{L}\p{N}]
	classLetter
	classNumber
	classSpace
)

var asciiClass [128]charClass

func init() {
	for c := 0; c < 128; c++ {
		asciiClass[c] = slowClass(rune(c))
	}
}

func slowClass(r rune) charClass {
	switch {
	case unicode.IsLetter(r):
		return classLetter
	case unicode.IsNumber(r):
		return classNumber
	case unicode.IsSpace(r): // Unicode White_Space, as \s in Oniguruma and .NET
		return classSpace
	}
	return classOther
}

// at decodes the rune at s[i] and its class. Invalid bytes decode as
// U+FFFD (class other) of width 1, as the regex path sees them.
func at(s string, i int) (rune, int, charClass) {
	if c := s[i]; c < utf8.RuneSelf {
		return rune(c), 1, asciiClass[c]
	}
	r, w := utf8.DecodeRuneInString(s[i:])
	return r, w, slowClass(r)
}

// runEnd returns the end of the run of class c starting at i.
func runEnd(s string, i int, c charClass) int {
	for i < len(s) {
		_, w, k := at(s, i)
		if k != c {
			break
		}
		i += w
	}
	return i
}

// llama3Next returns the end of the match that starts at i, trying the
// pattern's alternatives in order as the regex engine does. Every rune
// falls in some alternative, so a match always exists and is non-empty.
func llama3Next(s string, i, maxDigits int) int {
	r0, w0, c0 := at(s, i)
	// (?i:'s|'t|'re|'ve|'m|'ll|'d)
	if r0 == '\'' {
		if n := contraction(s[i+1:]); n > 0 {
			return i + 1 + n
		}
	}
	// [^\r\n\p{L}\p{N}]?\p{L}+
	if c0 == classLetter {
		return runEnd(s, i+w0, classLetter)
	}
	if r0 != '\r' && r0 != '\n' && c0 != classNumber && i+w0 < len(s) {
		if _, w1, c1 := at(s, i+w0); c1 == classLetter {
			return runEnd(s, i+w0+w1, classLetter)
		}
	}
	// \p{N}{1,3}
	if c0 == classNumber {
		j := i + w0
		for n := 1; j < len(s) && n < maxDigits; n++ {
			_, w, c := at(s, j)
			if c != classNumber {
				break
			}
			j += w
		}
		return j
	}
	// ' ?[^\s\p{L}\p{N}]+[\r\n]*'
	start := -1
	if c0 == classOther {
		start = i + w0
	} else if r0 == ' ' && i+1 < len(s) {
		if _, w1, c1 := at(s, i+1); c1 == classOther {
			start = i + 1 + w1
		}
	}
	if start >= 0 {
		j := runEnd(s, start, classOther)
		for j < len(s) && (s[j] == '\r' || s[j] == '\n') {
			j++
		}
		return j
	}
	// c0 is whitespace. \s*[\r\n]+ ends after the run's last newline.
	j, lastStart, lastNL := spaceRun(s, i)
	if lastNL >= 0 {
		return lastNL + 1
	}
	return spaceTail(s, i, j, lastStart)
}

// spaceRun scans the whitespace run at i: its end, the start of its last
// rune, and the offset of its last \r or \n (-1 if none).
func spaceRun(s string, i int) (end, lastStart, lastNL int) {
	lastNL, lastStart, end = -1, i, i
	for end < len(s) {
		r, w, c := at(s, end)
		if c != classSpace {
			break
		}
		if r == '\r' || r == '\n' {
			lastNL = end
		}
		lastStart = end
		end += w
	}
	return end, lastStart, lastNL
}

// spaceTail is \s+(?!\S)|\s+ on the run [i, end): the run less its last
// space when text follows (that space joins the next word), else the run.
func spaceTail(s string, i, end, lastStart int) int {
	if end < len(s) && lastStart > i {
		return lastStart
	}
	return end
}

// gpt2Next is llama3Next for GPT-2's pattern:
// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
func gpt2Next(s string, i int) int {
	r0, w0, c0 := at(s, i)
	if r0 == '\'' {
		if n := contractionExact(s[i+1:]); n > 0 {
			return i + 1 + n
		}
	}
	if c0 != classSpace {
		return runEnd(s, i+w0, c0)
	}
	if r0 == ' ' && i+1 < len(s) {
		if _, w1, c1 := at(s, i+1); c1 != classSpace {
			return runEnd(s, i+1+w1, c1)
		}
	}
	j, lastStart, _ := spaceRun(s, i)
	return spaceTail(s, i, j, lastStart)
}

// contractionExact is contraction for lower case only.
func contractionExact(s string) int {
	if s == "" {
		return 0
	}
	switch s[0] {
	case 's', 't', 'm', 'd':
		return 1
	case 'r', 'v':
		if len(s) > 1 && s[1] == 'e' {
			return 2
		}
	case 'l':
		if len(s) > 1 && s[1] == 'l' {
			return 2
		}
	}
	return 0
}

// contraction is the length of 's 't 're 've 'm 'll 'd (any case) after
// an apostrophe, or 0.
func contraction(s string) int {
	lower := func(k int) byte {
		if k >= len(s) {
			return 0
		}
		c := s[k]
		if c >= 'A' && c <= 'Z' {
			c += 'a' - 'A'
		}
		return c
	}
	switch lower(0) {
	case 's', 't', 'm', 'd':
		return 1
	case 'r', 'v':
		if lower(1) == 'e' {
			return 2
		}
	case 'l':
		if lower(1) == 'l' {
			return 2
		}
	}
	return 0
}
