package tokenizer

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"
)

// decoder turns token strings back into text pieces (HF decode_chain);
// the pieces are concatenated at the end.
type decoder func(tokens []string) []string

func buildDecoder(raw json.RawMessage) (decoder, error) {
	typ, ok, err := typeOf(raw)
	if err != nil || !ok {
		return nil, err
	}
	switch typ {
	case "Sequence":
		var spec struct {
			Decoders []json.RawMessage `json:"decoders"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, fmt.Errorf("Sequence: %v", err)
		}
		var steps []decoder
		for i, r := range spec.Decoders {
			d, err := buildDecoder(r)
			if err != nil {
				return nil, fmt.Errorf("Sequence[%d]: %w", i, err)
			}
			if d != nil {
				steps = append(steps, d)
			}
		}
		return func(toks []string) []string {
			for _, d := range steps {
				toks = d(toks)
			}
			return toks
		}, nil
	case "ByteLevel":
		return decodeByteLevel, nil
	case "ByteFallback":
		return decodeByteFallback, nil
	case "Fuse":
		return func(toks []string) []string { return []string{strings.Join(toks, "")} }, nil
	case "Replace":
		var spec struct {
			Pattern patternSpec `json:"pattern"`
			Content string      `json:"content"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, fmt.Errorf("Replace: %v", err)
		}
		rep, err := replacer(spec.Pattern, spec.Content)
		if err != nil {
			return nil, err
		}
		return func(toks []string) []string {
			out := make([]string, len(toks))
			for i, t := range toks {
				out[i] = rep(t)
			}
			return out
		}, nil
	case "Strip":
		var spec struct {
			Content string `json:"content"`
			Start   int    `json:"start"`
			Stop    int    `json:"stop"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, fmt.Errorf("Strip: %v", err)
		}
		if utf8.RuneCountInString(spec.Content) != 1 || spec.Start < 0 || spec.Stop < 0 {
			return nil, fmt.Errorf("Strip: want one content character and non-negative start/stop")
		}
		c, _ := utf8.DecodeRuneInString(spec.Content)
		return func(toks []string) []string {
			out := make([]string, len(toks))
			for i, t := range toks {
				out[i] = stripRune(t, c, spec.Start, spec.Stop)
			}
			return out
		}, nil
	case "Metaspace":
		var spec struct {
			Replacement    string `json:"replacement"`
			PrependScheme  string `json:"prepend_scheme"`
			AddPrefixSpace *bool  `json:"add_prefix_space"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, fmt.Errorf("Metaspace: %v", err)
		}
		if utf8.RuneCountInString(spec.Replacement) != 1 {
			return nil, fmt.Errorf("Metaspace: replacement must be one character, got %q", spec.Replacement)
		}
		strip := spec.PrependScheme != "never"
		if spec.PrependScheme == "" && spec.AddPrefixSpace != nil {
			strip = *spec.AddPrefixSpace
		}
		return func(toks []string) []string {
			out := make([]string, len(toks))
			for i, t := range toks {
				t = strings.ReplaceAll(t, spec.Replacement, " ")
				if i == 0 && strip {
					t = strings.TrimPrefix(t, " ")
				}
				out[i] = t
			}
			return out
		}, nil
	}
	return nil, fmt.Errorf("decoder type %q is not supported", typ)
}

// decodeByteLevel maps alphabet characters back to bytes. A token with a
// character outside the alphabet (an added token, say) contributes its
// UTF-8 bytes as they are.
func decodeByteLevel(toks []string) []string {
	var buf []byte
	for _, t := range toks {
		mark := len(buf)
		ok := true
		for _, r := range t {
			if r >= rune(len(runeToByte)) || runeToByte[r] < 0 {
				ok = false
				break
			}
			buf = append(buf, byte(runeToByte[r]))
		}
		if !ok {
			buf = append(buf[:mark], t...)
		}
	}
	return []string{lossyUTF8(buf)}
}

// decodeByteFallback turns runs of <0xNN> tokens into text; a run that is
// not valid UTF-8 becomes one U+FFFD per byte, as HF does.
func decodeByteFallback(toks []string) []string {
	out := make([]string, 0, len(toks))
	var run []byte
	flush := func() {
		if len(run) == 0 {
			return
		}
		if utf8.Valid(run) {
			out = append(out, string(run))
		} else {
			out = append(out, strings.Repeat("\uFFFD", len(run)))
		}
		run = run[:0]
	}
	for _, t := range toks {
		if b, ok := byteToken(t); ok {
			run = append(run, b)
			continue
		}
		flush()
		out = append(out, t)
	}
	flush()
	return out
}

// byteToken parses "<0xNN>".
func byteToken(t string) (byte, bool) {
	if len(t) != 6 || t[:3] != "<0x" || t[5] != '>' {
		return 0, false
	}
	hi, ok1 := hexVal(t[3])
	lo, ok2 := hexVal(t[4])
	return hi<<4 | lo, ok1 && ok2
}

func hexVal(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'a' && c <= 'f':
		return c - 'a' + 10, true
	case c >= 'A' && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// stripRune removes up to start leading and stop trailing c characters.
func stripRune(t string, c rune, start, stop int) string {
	for i := 0; i < start; i++ {
		r, n := utf8.DecodeRuneInString(t)
		if n == 0 || r != c {
			break
		}
		t = t[n:]
	}
	for i := 0; i < stop; i++ {
		r, n := utf8.DecodeLastRuneInString(t)
		if n == 0 || r != c {
			break
		}
		t = t[:len(t)-n]
	}
	return t
}

// lossyUTF8 converts bytes to a string the way Rust's
// String::from_utf8_lossy does: each maximal prefix of an ill-formed
// sequence becomes one U+FFFD (Go's DecodeRune would give one per byte).
func lossyUTF8(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	var sb strings.Builder
	sb.Grow(len(b) + 8)
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		if r != utf8.RuneError || n > 1 {
			sb.Write(b[i : i+n])
			i += n
			continue
		}
		sb.WriteRune(utf8.RuneError)
		i += invalidPrefixLen(b[i:])
	}
	return sb.String()
}

// invalidPrefixLen is the length of the maximal prefix of b that could
// start a valid sequence but does not complete one (at least 1).
func invalidPrefixLen(b []byte) int {
	c := b[0]
	var need int
	lo, hi := byte(0x80), byte(0xBF)
	switch {
	case c >= 0xC2 && c <= 0xDF:
		need = 1
	case c == 0xE0:
		need, lo = 2, 0xA0
	case c >= 0xE1 && c <= 0xEC, c == 0xEE, c == 0xEF:
		need = 2
	case c == 0xED:
		need, hi = 2, 0x9F
	case c == 0xF0:
		need, lo = 3, 0x90
	case c >= 0xF1 && c <= 0xF3:
		need = 3
	case c == 0xF4:
		need, hi = 3, 0x8F
	default:
		return 1
	}
	n := 1
	for k := 0; k < need && n < len(b); k++ {
		x := b[n]
		if k == 0 && (x < lo || x > hi) || k > 0 && (x < 0x80 || x > 0xBF) {
			break
		}
		n++
	}
	return n
}
