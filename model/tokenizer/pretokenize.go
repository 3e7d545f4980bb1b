package tokenizer

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/dlclark/regexp2"
)

// piece is a pre-token: a substring the BPE model encodes on its own.
type piece struct {
	text    string
	atStart bool // begins at offset 0 of the original text (Metaspace "first")
}

// preTokenizer splits pieces into smaller pieces.
type preTokenizer func(in []piece) []piece

// useFastSplit enables the hand-written splitters of fastsplit.go; tests
// turn it off to measure and compare against the regex path.
var useFastSplit = true

// gpt2Pattern is the split the ByteLevel pre-tokenizer uses with use_regex.
const gpt2Pattern = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`

// buildPreTokenizer returns the pre-tokenizer and whether its output is
// to be byte-level encoded (a ByteLevel step, which must come last).
func buildPreTokenizer(raw json.RawMessage) (preTokenizer, bool, error) {
	typ, ok, err := typeOf(raw)
	if err != nil || !ok {
		return nil, false, err
	}
	switch typ {
	case "Sequence":
		var spec struct {
			PreTokenizers []json.RawMessage `json:"pretokenizers"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, false, fmt.Errorf("Sequence: %v", err)
		}
		var steps []preTokenizer
		byteLevel := false
		for i, r := range spec.PreTokenizers {
			if byteLevel {
				return nil, false, fmt.Errorf("Sequence[%d]: a pre-tokenizer after ByteLevel is not supported", i)
			}
			p, bl, err := buildPreTokenizer(r)
			if err != nil {
				return nil, false, fmt.Errorf("Sequence[%d]: %w", i, err)
			}
			if p != nil {
				steps = append(steps, p)
			}
			byteLevel = bl
		}
		return func(in []piece) []piece {
			for _, p := range steps {
				in = p(in)
			}
			return in
		}, byteLevel, nil
	case "Split":
		var spec struct {
			Pattern  patternSpec `json:"pattern"`
			Behavior string      `json:"behavior"`
			Invert   bool        `json:"invert"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, false, fmt.Errorf("Split: %v", err)
		}
		var re *regexp2.Regexp
		switch {
		case spec.Pattern.Regex != nil:
			re, err = regexp2.Compile(*spec.Pattern.Regex, regexp2.None)
			if err != nil {
				return nil, false, fmt.Errorf("Split: bad regex %q: %v", *spec.Pattern.Regex, err)
			}
		case spec.Pattern.String != nil && *spec.Pattern.String != "":
			re = regexp2.MustCompile(regexp2.Escape(*spec.Pattern.String), regexp2.None)
		default:
			return nil, false, fmt.Errorf("Split: pattern needs \"String\" or \"Regex\"")
		}
		if !validBehavior(spec.Behavior) {
			return nil, false, fmt.Errorf("Split: behavior %q is not supported", spec.Behavior)
		}
		if useFastSplit && spec.Pattern.Regex != nil && spec.Behavior == "Isolated" && !spec.Invert {
			if fast := fastSplitter(*spec.Pattern.Regex); fast != nil {
				return fast, false, nil
			}
		}
		return regexSplitter(re, spec.Behavior, spec.Invert), false, nil
	case "ByteLevel":
		var spec struct {
			AddPrefixSpace bool  `json:"add_prefix_space"`
			UseRegex       *bool `json:"use_regex"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, false, fmt.Errorf("ByteLevel: %v", err)
		}
		var split preTokenizer
		if spec.UseRegex == nil || *spec.UseRegex {
			if split = fastSplitter(gpt2Pattern); !useFastSplit || split == nil {
				split = regexSplitter(regexp2.MustCompile(gpt2Pattern, regexp2.None), "Isolated", false)
			}
		}
		return func(in []piece) []piece {
			if spec.AddPrefixSpace {
				for i := range in {
					if !strings.HasPrefix(in[i].text, " ") {
						in[i].text = " " + in[i].text
					}
				}
			}
			if split != nil {
				in = split(in)
			}
			return in
		}, true, nil
	case "Metaspace":
		var spec struct {
			Replacement    string `json:"replacement"`
			PrependScheme  string `json:"prepend_scheme"`
			AddPrefixSpace *bool  `json:"add_prefix_space"` // older files
			Split          *bool  `json:"split"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, false, fmt.Errorf("Metaspace: %v", err)
		}
		if utf8.RuneCountInString(spec.Replacement) != 1 {
			return nil, false, fmt.Errorf("Metaspace: replacement must be one character, got %q", spec.Replacement)
		}
		scheme := spec.PrependScheme
		if scheme == "" {
			scheme = "always"
			if spec.AddPrefixSpace != nil && !*spec.AddPrefixSpace {
				scheme = "never"
			}
		}
		if scheme != "always" && scheme != "first" && scheme != "never" {
			return nil, false, fmt.Errorf("Metaspace: prepend_scheme %q is not supported", scheme)
		}
		split := spec.Split == nil || *spec.Split
		rep := spec.Replacement
		return func(in []piece) []piece {
			var out []piece
			for _, p := range in {
				s := strings.ReplaceAll(p.text, " ", rep)
				if (scheme == "always" || (scheme == "first" && p.atStart)) && !strings.HasPrefix(s, rep) {
					s = rep + s
				}
				if !split {
					out = append(out, piece{s, p.atStart})
					continue
				}
				// MergedWithNext: each replacement starts a new piece.
				start := 0
				for i := 0; i < len(s); {
					j := strings.Index(s[i:], rep)
					if j < 0 {
						break
					}
					if i+j > start {
						out = append(out, piece{s[start : i+j], p.atStart && start == 0})
						start = i + j
					}
					i += j + len(rep)
				}
				if start < len(s) {
					out = append(out, piece{s[start:], p.atStart && start == 0})
				}
			}
			return out
		}, false, nil
	case "Digits":
		var spec struct {
			Individual bool `json:"individual_digits"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, false, fmt.Errorf("Digits: %v", err)
		}
		behavior := "Contiguous"
		if spec.Individual {
			behavior = "Isolated"
		}
		return regexSplitter(regexp2.MustCompile(`\p{N}`, regexp2.None), behavior, false), false, nil
	case "WhitespaceSplit":
		return regexSplitter(regexp2.MustCompile(`\s+`, regexp2.None), "Removed", false), false, nil
	case "Whitespace":
		return regexSplitter(regexp2.MustCompile(`\w+|[^\w\s]+`, regexp2.None), "Removed", true), false, nil
	}
	return nil, false, fmt.Errorf("pre_tokenizer type %q is not supported", typ)
}

func validBehavior(b string) bool {
	switch b {
	case "Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous":
		return true
	}
	return false
}

// span is a byte range of a piece and whether the pattern matched it.
type span struct {
	start, end int
	match      bool
}

// regexSplitter implements the Split pre-tokenizer: the matches and the
// text between them, combined per behavior (HF SplitDelimiterBehavior).
func regexSplitter(re *regexp2.Regexp, behavior string, invert bool) preTokenizer {
	return func(in []piece) []piece {
		out := make([]piece, 0, len(in)*4)
		for _, p := range in {
			s := p.text
			var spans []span
			prev := 0
			for _, m := range regexSpans(re, s) {
				if prev < m[0] {
					spans = append(spans, span{prev, m[0], invert})
				}
				spans = append(spans, span{m[0], m[1], !invert})
				prev = m[1]
			}
			if prev < len(s) {
				spans = append(spans, span{prev, len(s), invert})
			}
			for _, sp := range combine(spans, behavior) {
				if sp.start < sp.end {
					out = append(out, piece{s[sp.start:sp.end], p.atStart && sp.start == 0})
				}
			}
		}
		return out
	}
}

func combine(spans []span, behavior string) []span {
	var out []span
	prevMatch := false
	switch behavior {
	case "Isolated":
		return spans
	case "Removed":
		for _, s := range spans {
			if !s.match {
				out = append(out, s)
			}
		}
	case "MergedWithPrevious":
		for _, s := range spans {
			if s.match && !prevMatch && len(out) > 0 {
				out[len(out)-1].end = s.end
			} else {
				out = append(out, s)
			}
			prevMatch = s.match
		}
	case "MergedWithNext":
		for i := len(spans) - 1; i >= 0; i-- {
			s := spans[i]
			if s.match && !prevMatch && len(out) > 0 {
				out[len(out)-1].start = s.start
			} else {
				out = append(out, s)
			}
			prevMatch = s.match
		}
		for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
			out[i], out[j] = out[j], out[i]
		}
	case "Contiguous":
		for i, s := range spans {
			if i > 0 && s.match == prevMatch {
				out[len(out)-1].end = s.end
			} else {
				out = append(out, s)
			}
			prevMatch = s.match
		}
	}
	return out
}

// regexSpans returns the byte ranges of the non-overlapping matches of re
// in s. regexp2 works on runes; invalid UTF-8 bytes count as one rune each
// (as []rune and utf8.DecodeRune both treat them), so offsets map back.
func regexSpans(re *regexp2.Regexp, s string) [][2]int {
	if s == "" {
		return nil
	}
	runes := []rune(s)
	offs := make([]int, len(runes)+1)
	b := 0
	for i := range runes {
		offs[i] = b
		_, w := utf8.DecodeRuneInString(s[b:])
		b += w
	}
	offs[len(runes)] = len(s)
	var out [][2]int
	m, err := re.FindRunesMatch(runes)
	for m != nil && err == nil {
		out = append(out, [2]int{offs[m.Index], offs[m.Index+m.Length]})
		m, err = re.FindNextMatch(m)
	}
	return out
}

// byteToRune is GPT-2's bytes_to_unicode: printable bytes stand for
// themselves, the rest map to U+0100 and up in byte order.
var byteToRune [256]rune

// runeToByte inverts byteToRune: index by rune (all are below 0x144);
// -1 marks runes that are not byte-level symbols.
var runeToByte [0x144]int16

func init() {
	for i := range runeToByte {
		runeToByte[i] = -1
	}
	n := 0
	for b := 0; b < 256; b++ {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			byteToRune[b] = rune(b)
		} else {
			byteToRune[b] = rune(256 + n)
			n++
		}
		runeToByte[byteToRune[b]] = int16(b)
	}
}

// ByteLevel maps raw bytes to their byte-level alphabet string (the
// spelling of byte-level BPE vocabularies and merges).
func ByteLevel(s string) string {
	var b strings.Builder
	b.Grow(len(s) * 2)
	for i := 0; i < len(s); i++ {
		b.WriteRune(byteToRune[s[i]])
	}
	return b.String()
}
