// Package tokenizer reads Hugging Face tokenizer.json files (and the
// tokenizer.ggml.* metadata of GGUF files, see FromGGUF) and encodes and
// decodes text exactly as the tokenizers library does, for the BPE
// families meshgpu serves: byte-level BPE with a split regex (Llama 3,
// Qwen2) and SentencePiece-style BPE with byte fallback (Llama 2,
// TinyLlama, Mistral). A Tokenizer is safe for concurrent use.
package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// maxTokenID bounds ids read from files so a hostile file cannot make us
// allocate an id table of billions of entries.
const maxTokenID = 1 << 24

// Tokenizer encodes text to token ids and back.
type Tokenizer struct {
	model     *bpe
	normalize normalizer   // nil: none
	preTok    preTokenizer // nil: the whole segment is one word
	dec       decoder      // nil: tokens joined by spaces
	rawAdded  []addedToken // matched in the raw text
	rawMatch  *matcher
	normAdded []addedToken // matched in the normalized text
	normMatch *matcher
	idToToken []string
	hasToken  []bool
	special   []bool
	tokenToID map[string]int32
	prefix    []int32 // added before the text when addSpecial
	suffix    []int32 // added after it
	bos       int32   // -1 when unknown
	eos       []int32
}

// Load reads dir/tokenizer.json and, when present, dir/tokenizer_config.json.
func Load(dir string) (*Tokenizer, error) {
	cfg := filepath.Join(dir, "tokenizer_config.json")
	if _, err := os.Stat(cfg); err != nil {
		cfg = ""
	}
	return LoadFile(filepath.Join(dir, "tokenizer.json"), cfg)
}

// LoadFile reads a tokenizer.json and an optional tokenizer_config.json
// (pass "" for none).
func LoadFile(tokenizerJSON, tokenizerConfigJSON string) (*Tokenizer, error) {
	data, err := os.ReadFile(tokenizerJSON)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	var cfgData []byte
	if tokenizerConfigJSON != "" {
		if cfgData, err = os.ReadFile(tokenizerConfigJSON); err != nil {
			return nil, fmt.Errorf("tokenizer: %w", err)
		}
	}
	t, err := parse(data, cfgData)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %s: %w", tokenizerJSON, err)
	}
	return t, nil
}

// parse builds a tokenizer from the bytes of tokenizer.json and of
// tokenizer_config.json (nil when absent).
func parse(data, cfgData []byte) (*Tokenizer, error) {
	var spec fileSpec
	if err := json.Unmarshal(data, &spec); err != nil {
		return nil, fmt.Errorf("not a valid tokenizer.json: %v", err)
	}
	var cfg configSpec
	if cfgData != nil {
		if err := json.Unmarshal(cfgData, &cfg); err != nil {
			return nil, fmt.Errorf("not a valid tokenizer_config.json: %v", err)
		}
	}
	if isNull(spec.Model) {
		return nil, errors.New("\"model\" is missing")
	}
	var ms modelSpec
	if err := json.Unmarshal(spec.Model, &ms); err != nil {
		return nil, fmt.Errorf("model: %v", err)
	}
	merges, err := parseMerges(ms.Merges)
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	return build(&spec, &ms, merges, nil, &cfg)
}

// build makes a tokenizer from a decoded tokenizer.json document: the one
// construction shared by tokenizer.json and GGUF files. merges are the
// model's merge pairs and ranks their priorities (lower merges first);
// nil ranks mean list order.
func build(spec *fileSpec, ms *modelSpec, merges [][2]string, ranks []int32, cfg *configSpec) (*Tokenizer, error) {
	model, err := newBPE(ms, merges, ranks)
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	t := &Tokenizer{model: model, bos: -1}
	if t.normalize, err = buildNormalizer(spec.Normalizer); err != nil {
		return nil, fmt.Errorf("normalizer: %w", err)
	}
	var byteLevel bool
	if t.preTok, byteLevel, err = buildPreTokenizer(spec.PreTokenizer); err != nil {
		return nil, fmt.Errorf("pre_tokenizer: %w", err)
	}
	if byteLevel {
		model.enableByteLevel()
	}
	if t.dec, err = buildDecoder(spec.Decoder); err != nil {
		return nil, fmt.Errorf("decoder: %w", err)
	}
	if err := t.buildVocab(spec.AddedTokens); err != nil {
		return nil, err
	}
	if err := t.buildPostProcessor(spec.PostProcessor); err != nil {
		return nil, fmt.Errorf("post_processor: %w", err)
	}
	if err := t.applyConfig(cfg); err != nil {
		return nil, fmt.Errorf("tokenizer_config: %w", err)
	}
	return t, nil
}

func (t *Tokenizer) buildVocab(added []addedTokenSpec) error {
	maxID := int64(-1)
	for _, id := range t.model.vocab {
		maxID = max(maxID, int64(id))
	}
	for i, a := range added {
		if a.ID == nil || *a.ID < 0 || *a.ID >= maxTokenID {
			return fmt.Errorf("added_tokens[%d]: want an id in [0, %d)", i, maxTokenID)
		}
		if a.Content == "" {
			return fmt.Errorf("added_tokens[%d]: empty content", i)
		}
		maxID = max(maxID, *a.ID)
	}
	n := int(maxID + 1)
	t.idToToken = make([]string, n)
	t.hasToken = make([]bool, n)
	t.special = make([]bool, n)
	t.tokenToID = make(map[string]int32, len(t.model.vocab)+len(added))
	for tok, id := range t.model.vocab { // ids are unique (newBPE checks)
		t.idToToken[id], t.hasToken[id] = tok, true
		t.tokenToID[tok] = id
	}
	var rawContents, normContents []string
	for _, a := range added {
		id := int32(*a.ID)
		t.idToToken[id], t.hasToken[id] = a.Content, true
		t.special[id] = a.Special
		t.tokenToID[a.Content] = id
		at := addedToken{id: id, content: a.Content, singleWord: a.SingleWord, lstrip: a.LStrip,
			rstrip: a.RStrip, normalized: a.Normalized, special: a.Special}
		if a.Normalized && t.normalize != nil {
			// HF matches and decodes a normalized added token by its
			// normalized form (Prepend makes "<x>" decode as "▁<x>").
			nc := t.normalize(a.Content)
			t.idToToken[id] = nc
			t.normAdded = append(t.normAdded, at)
			normContents = append(normContents, nc)
		} else if a.Normalized {
			t.normAdded = append(t.normAdded, at)
			normContents = append(normContents, a.Content)
		} else {
			t.rawAdded = append(t.rawAdded, at)
			rawContents = append(rawContents, a.Content)
		}
	}
	t.rawMatch = newMatcher(rawContents)
	t.normMatch = newMatcher(normContents)
	return nil
}

// buildPostProcessor reads the ids a single sequence is wrapped in.
func (t *Tokenizer) buildPostProcessor(raw json.RawMessage) error {
	pre, suf, err := t.postProcessor(raw)
	if err != nil {
		return err
	}
	t.prefix, t.suffix = pre, suf
	return nil
}

func (t *Tokenizer) postProcessor(raw json.RawMessage) (prefix, suffix []int32, err error) {
	typ, ok, err := typeOf(raw)
	if err != nil || !ok {
		return nil, nil, err
	}
	switch typ {
	case "ByteLevel":
		return nil, nil, nil
	case "Sequence":
		var spec struct {
			Processors []json.RawMessage `json:"processors"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, nil, fmt.Errorf("Sequence: %v", err)
		}
		for i, r := range spec.Processors {
			p, s, err := t.postProcessor(r)
			if err != nil {
				return nil, nil, fmt.Errorf("Sequence[%d]: %w", i, err)
			}
			prefix = append(p, prefix...)
			suffix = append(suffix, s...)
		}
		return prefix, suffix, nil
	case "TemplateProcessing":
		var spec struct {
			Single []struct {
				SpecialToken *struct {
					ID string `json:"id"`
				} `json:"SpecialToken"`
				Sequence *struct {
					ID string `json:"id"`
				} `json:"Sequence"`
			} `json:"single"`
			SpecialTokens map[string]struct {
				IDs []int64 `json:"ids"`
			} `json:"special_tokens"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, nil, fmt.Errorf("TemplateProcessing: %v", err)
		}
		seenA := false
		for i, item := range spec.Single {
			switch {
			case item.Sequence != nil:
				if seenA {
					return nil, nil, fmt.Errorf("TemplateProcessing: single has two sequences")
				}
				seenA = true
			case item.SpecialToken != nil:
				st, ok := spec.SpecialTokens[item.SpecialToken.ID]
				if !ok {
					return nil, nil, fmt.Errorf("TemplateProcessing: special token %q is not in special_tokens", item.SpecialToken.ID)
				}
				for _, id := range st.IDs {
					if id < 0 || id >= int64(len(t.idToToken)) {
						return nil, nil, fmt.Errorf("TemplateProcessing: special token %q has id %d outside the vocab", item.SpecialToken.ID, id)
					}
					if seenA {
						suffix = append(suffix, int32(id))
					} else {
						prefix = append(prefix, int32(id))
					}
				}
			default:
				return nil, nil, fmt.Errorf("TemplateProcessing: single[%d] is neither SpecialToken nor Sequence", i)
			}
		}
		return prefix, suffix, nil
	case "RobertaProcessing", "BertProcessing":
		var spec struct {
			Sep [2]json.RawMessage `json:"sep"`
			Cls [2]json.RawMessage `json:"cls"`
		}
		if err := json.Unmarshal(raw, &spec); err != nil {
			return nil, nil, fmt.Errorf("%s: %v", typ, err)
		}
		var cls, sep int64
		if json.Unmarshal(spec.Cls[1], &cls) != nil || json.Unmarshal(spec.Sep[1], &sep) != nil ||
			cls < 0 || sep < 0 || cls >= int64(len(t.idToToken)) || sep >= int64(len(t.idToToken)) {
			return nil, nil, fmt.Errorf("%s: want cls and sep as [token, id] within the vocab", typ)
		}
		return []int32{int32(cls)}, []int32{int32(sep)}, nil
	}
	return nil, nil, fmt.Errorf("post_processor type %q is not supported", typ)
}

// applyConfig takes BOS/EOS from tokenizer_config.json and honours an
// explicit add_bos_token / add_eos_token the way transformers' Llama
// tokenizers rebuild their post-processor from them.
func (t *Tokenizer) applyConfig(cfg *configSpec) error {
	if cfg.BOSToken != "" {
		id, ok := t.tokenToID[string(cfg.BOSToken)]
		if !ok {
			return fmt.Errorf("bos_token %q is not in the vocab", cfg.BOSToken)
		}
		t.bos = id
	} else if len(t.prefix) > 0 {
		t.bos = t.prefix[0]
	}
	if cfg.EOSToken != "" {
		id, ok := t.tokenToID[string(cfg.EOSToken)]
		if !ok {
			return fmt.Errorf("eos_token %q is not in the vocab", cfg.EOSToken)
		}
		t.eos = []int32{id}
	} else {
		// No config: fall back to the usual end-of-text names.
		for _, name := range []string{"</s>", "<|end_of_text|>", "<|endoftext|>"} {
			if id, ok := t.tokenToID[name]; ok && t.special[id] {
				t.eos = []int32{id}
				break
			}
		}
	}
	if cfg.AddBOSToken != nil && t.bos >= 0 {
		hasBOS := len(t.prefix) > 0 && t.prefix[0] == t.bos
		switch {
		case *cfg.AddBOSToken && !hasBOS:
			t.prefix = append([]int32{t.bos}, t.prefix...)
		case !*cfg.AddBOSToken && hasBOS:
			t.prefix = t.prefix[1:]
		}
	}
	if cfg.AddEOSToken != nil && len(t.eos) > 0 {
		eos := t.eos[0]
		hasEOS := len(t.suffix) > 0 && t.suffix[len(t.suffix)-1] == eos
		switch {
		case *cfg.AddEOSToken && !hasEOS:
			t.suffix = append(t.suffix, eos)
		case !*cfg.AddEOSToken && hasEOS:
			t.suffix = t.suffix[:len(t.suffix)-1]
		}
	}
	return nil
}

// Encode returns the ids of text. With addSpecial the post-processor's
// tokens (BOS for Llama-family tokenizers) are added. Text that spells an
// added or special token encodes to that token, as in Hugging Face.
func (t *Tokenizer) Encode(text string, addSpecial bool) []int32 {
	ids := make([]int32, 0, len(text)/3+len(t.prefix)+len(t.suffix)+1)
	if addSpecial {
		ids = append(ids, t.prefix...)
	}
	var segs, subs []segment
	segs = splitAdded(text, true, t.rawMatch, t.rawAdded, segs)
	for _, sg := range segs {
		if sg.tok >= 0 {
			ids = append(ids, sg.tok)
			continue
		}
		s := sg.text
		if t.normalize != nil {
			s = t.normalize(s)
		}
		subs = splitAdded(s, sg.atStart, t.normMatch, t.normAdded, subs[:0])
		for _, sub := range subs {
			if sub.tok >= 0 {
				ids = append(ids, sub.tok)
				continue
			}
			if t.preTok == nil {
				ids = t.model.encodeWord(ids, sub.text)
				continue
			}
			for _, p := range t.preTok([]piece{{sub.text, sub.atStart}}) {
				ids = t.model.encodeWord(ids, p.text)
			}
		}
	}
	if addSpecial {
		ids = append(ids, t.suffix...)
	}
	return ids
}

// Decode returns the text of ids. Ids outside the vocab are skipped; with
// skipSpecial so are special tokens.
func (t *Tokenizer) Decode(ids []int32, skipSpecial bool) string {
	toks := make([]string, 0, len(ids))
	for _, id := range ids {
		if id < 0 || int(id) >= len(t.idToToken) || !t.hasToken[id] {
			continue
		}
		if skipSpecial && t.special[id] {
			continue
		}
		toks = append(toks, t.idToToken[id])
	}
	if t.dec == nil {
		return strings.Join(toks, " ")
	}
	return strings.Join(t.dec(toks), "")
}

// VocabSize is one more than the largest token id, added tokens included.
func (t *Tokenizer) VocabSize() int { return len(t.idToToken) }

// BOS is the beginning-of-sequence token: tokenizer_config's bos_token,
// else the first token the post-processor adds (a GGUF's bos_token_id).
func (t *Tokenizer) BOS() (int32, bool) { return t.bos, t.bos >= 0 }

// EOS lists the end-of-sequence tokens named by tokenizer_config's
// eos_token (or a conventional name when there is no config). Callers add
// the ids from config.json / generation_config.json. From a GGUF: its
// eos_token_id, then eot_token_id and eom_token_id.
func (t *Tokenizer) EOS() []int32 { return append([]int32(nil), t.eos...) }

// TokenID returns the id of a token string (vocab or added token).
func (t *Tokenizer) TokenID(s string) (int32, bool) {
	id, ok := t.tokenToID[s]
	return id, ok
}

// IsSpecial reports whether id is an added token marked special.
func (t *Tokenizer) IsSpecial(id int32) bool {
	return id >= 0 && int(id) < len(t.special) && t.special[id]
}

// Token returns the vocabulary string of id.
func (t *Tokenizer) Token(id int32) (string, bool) {
	if id < 0 || int(id) >= len(t.idToToken) || !t.hasToken[id] {
		return "", false
	}
	return t.idToToken[id], true
}
