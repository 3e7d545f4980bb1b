package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// The JSON shapes of Hugging Face tokenizer.json that we read. Components
// (normalizer, pre_tokenizer, decoder, post_processor) are polymorphic on
// "type", so they stay raw until their builder looks at the type.

type fileSpec struct {
	AddedTokens   []addedTokenSpec `json:"added_tokens"`
	Normalizer    json.RawMessage  `json:"normalizer"`
	PreTokenizer  json.RawMessage  `json:"pre_tokenizer"`
	Model         json.RawMessage  `json:"model"`
	PostProcessor json.RawMessage  `json:"post_processor"`
	Decoder       json.RawMessage  `json:"decoder"`
}

type addedTokenSpec struct {
	ID         *int64 `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Normalized bool   `json:"normalized"`
	Special    bool   `json:"special"`
}

type modelSpec struct {
	Type                    string           `json:"type"`
	Vocab                   map[string]int64 `json:"vocab"`
	Merges                  json.RawMessage  `json:"merges"`
	UnkToken                *string          `json:"unk_token"`
	ContinuingSubwordPrefix *string          `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string          `json:"end_of_word_suffix"`
	FuseUnk                 bool             `json:"fuse_unk"`
	ByteFallback            bool             `json:"byte_fallback"`
	IgnoreMerges            bool             `json:"ignore_merges"`
}

// configSpec is the part of tokenizer_config.json the tokenizer needs.
type configSpec struct {
	BOSToken    TokenName `json:"bos_token"`
	EOSToken    TokenName `json:"eos_token"`
	AddBOSToken *bool     `json:"add_bos_token"`
	AddEOSToken *bool     `json:"add_eos_token"`
}

// TokenName is a token as tokenizer_config.json gives it: a plain string
// or an AddedToken object {"content": ...}; null leaves it empty.
type TokenName string

func (n *TokenName) UnmarshalJSON(b []byte) error {
	var s *string
	if err := json.Unmarshal(b, &s); err == nil {
		if s != nil {
			*n = TokenName(*s)
		}
		return nil
	}
	var obj struct {
		Content string `json:"content"`
	}
	if err := json.Unmarshal(b, &obj); err != nil {
		return fmt.Errorf("want a string or {\"content\": string}, got %s", abbrev(b))
	}
	*n = TokenName(obj.Content)
	return nil
}

// typeOf reads the "type" field of a component; ok is false for null.
func typeOf(raw json.RawMessage) (string, bool, error) {
	if isNull(raw) {
		return "", false, nil
	}
	var head struct {
		Type string `json:"type"`
	}
	if err := json.Unmarshal(raw, &head); err != nil {
		return "", false, fmt.Errorf("want an object with a \"type\", got %s", abbrev(raw))
	}
	if head.Type == "" {
		return "", false, fmt.Errorf("missing \"type\" in %s", abbrev(raw))
	}
	return head.Type, true, nil
}

func isNull(raw json.RawMessage) bool {
	s := strings.TrimSpace(string(raw))
	return s == "" || s == "null"
}

// abbrev shortens JSON for error messages.
func abbrev(b []byte) string {
	s := strings.TrimSpace(string(b))
	if len(s) > 80 {
		s = s[:77] + "..."
	}
	return s
}

// patternSpec is {"String": "..."} or {"Regex": "..."}.
type patternSpec struct {
	String *string `json:"String"`
	Regex  *string `json:"Regex"`
}

// parseMerges accepts both layouts: ["a b", ...] and [["a", "b"], ...].
func parseMerges(raw json.RawMessage) ([][2]string, error) {
	if isNull(raw) {
		return nil, nil
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, errors.New("model.merges: want a list")
	}
	out := make([][2]string, 0, len(items))
	for i, it := range items {
		var s string
		if err := json.Unmarshal(it, &s); err == nil {
			a, b, ok := strings.Cut(s, " ")
			if !ok || a == "" || b == "" || strings.Contains(b, " ") {
				return nil, fmt.Errorf("model.merges[%d]: want \"left right\", got %q", i, s)
			}
			out = append(out, [2]string{a, b})
			continue
		}
		var pair []string
		if err := json.Unmarshal(it, &pair); err != nil || len(pair) != 2 {
			return nil, fmt.Errorf("model.merges[%d]: want \"left right\" or [left, right], got %s", i, abbrev(it))
		}
		out = append(out, [2]string{pair[0], pair[1]})
	}
	return out, nil
}
