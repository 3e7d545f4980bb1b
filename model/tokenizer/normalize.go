package tokenizer

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/dlclark/regexp2"
	"golang.org/x/text/unicode/norm"
)

// normalizer rewrites a text segment before pre-tokenization.
type normalizer func(s string) string

func buildNormalizer(raw json.RawMessage) (normalizer, error) {
	typ, ok, err := typeOf(raw)
	if err != nil || !ok {
		return nil, err
	}
	switch typ {
	case "Sequence":
		var spec struct {
			Normalizers []json.RawMessage `json:"normalizers"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, fmt.Errorf("Sequence: %v", err)
		}
		var steps []normalizer
		for i, r := range spec.Normalizers {
			n, err := buildNormalizer(r)
			if err != nil {
				return nil, fmt.Errorf("Sequence[%d]: %w", i, err)
			}
			if n != nil {
				steps = append(steps, n)
			}
		}
		return func(s string) string {
			for _, n := range steps {
				s = n(s)
			}
			return s
		}, nil
	case "Prepend":
		var spec struct {
			Prepend string `json:"prepend"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, fmt.Errorf("Prepend: %v", err)
		}
		return func(s string) string {
			if s == "" {
				return s
			}
			return spec.Prepend + s
		}, nil
	case "Replace":
		var spec struct {
			Pattern patternSpec `json:"pattern"`
			Content string      `json:"content"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, fmt.Errorf("Replace: %v", err)
		}
		return replacer(spec.Pattern, spec.Content)
	case "NFC":
		return norm.NFC.String, nil
	case "NFD":
		return norm.NFD.String, nil
	case "NFKC":
		return norm.NFKC.String, nil
	case "NFKD":
		return norm.NFKD.String, nil
	case "Lowercase":
		return strings.ToLower, nil
	case "Strip":
		var spec struct {
			Left  bool `json:"strip_left"`
			Right bool `json:"strip_right"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, fmt.Errorf("Strip: %v", err)
		}
		return func(s string) string {
			if spec.Left {
				s = s[leadingSpace(s):]
			}
			if spec.Right {
				s = s[:len(s)-trailingSpace(s)]
			}
			return s
		}, nil
	}
	return nil, fmt.Errorf("normalizer type %q is not supported", typ)
}

// replacer replaces a literal string or regex matches with content.
func replacer(p patternSpec, content string) (func(string) string, error) {
	switch {
	case p.String != nil:
		if *p.String == "" {
			return nil, fmt.Errorf("Replace: empty pattern")
		}
		old := *p.String
		return func(s string) string { return strings.ReplaceAll(s, old, content) }, nil
	case p.Regex != nil:
		re, err := regexp2.Compile(*p.Regex, regexp2.None)
		if err != nil {
			return nil, fmt.Errorf("Replace: bad regex %q: %v", *p.Regex, err)
		}
		return func(s string) string {
			var b strings.Builder
			last := 0
			for _, sp := range regexSpans(re, s) {
				b.WriteString(s[last:sp[0]])
				b.WriteString(content)
				last = sp[1]
			}
			b.WriteString(s[last:])
			return b.String()
		}, nil
	}
	return nil, fmt.Errorf("Replace: pattern needs \"String\" or \"Regex\"")
}
