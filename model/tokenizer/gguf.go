package tokenizer

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"
	"unicode/utf8"

	"meshgpu/model/gguf"
)

// A GGUF file (llama.cpp's format) carries its vocabulary as
// tokenizer.ggml.* metadata instead of a tokenizer.json. FromGGUF turns
// that metadata into the tokenizer.json components that behave as
// llama.cpp's tokenizer for the vocab type does, and hands them to build,
// the constructor Load uses too, so there is one BPE implementation.

// llama.cpp's token types, the values of tokenizer.ggml.token_type.
const (
	ggufUndefined   = 0
	ggufNormal      = 1
	ggufUnknown     = 2
	ggufControl     = 3
	ggufUserDefined = 4
	ggufUnused      = 5
	ggufByte        = 6
)

// ggufPre is what a tokenizer.ggml.pre name stands for in a byte-level
// ("gpt2") vocab: the normalizer and pre-tokenizer of the model's
// tokenizer.json (JSON), and llama.cpp's settings for it.
type ggufPre struct {
	normalizer   string // "" for none
	preTokenizer string
	ignoreMerges bool // a word that is a token is taken whole (Llama 3)
	addBOS       bool // llama.cpp's default when add_bos_token is absent
}

func splitThenByteLevel(pattern string) string {
	return fmt.Sprintf(`{"type":"Sequence","pretokenizers":[`+
		`{"type":"Split","pattern":{"Regex":%q},"behavior":"Isolated","invert":false},`+
		`{"type":"ByteLevel","add_prefix_space":false,"use_regex":false}]}`, pattern)
}

var (
	preLlama3 = ggufPre{preTokenizer: splitThenByteLevel(llama3Pattern), ignoreMerges: true, addBOS: true}
	// Qwen2's tokenizer.json normalizes to NFC, which llama.cpp skips; we
	// follow the tokenizer the model was trained with.
	preQwen2 = ggufPre{normalizer: `{"type":"NFC"}`, preTokenizer: splitThenByteLevel(qwen2Pattern)}
	preGPT2  = ggufPre{preTokenizer: `{"type":"ByteLevel","add_prefix_space":false,"use_regex":true}`}
	// SmolLM and StarCoder isolate each digit, then split as GPT-2.
	preDigitsGPT2 = ggufPre{preTokenizer: `{"type":"Sequence","pretokenizers":[` +
		`{"type":"Digits","individual_digits":true},` +
		`{"type":"ByteLevel","add_prefix_space":false,"use_regex":true}]}`}
)

// ggufPres maps llama.cpp's names (tokenizer.ggml.pre) to their splits.
// An absent name means GPT-2's split.
var ggufPres = map[string]ggufPre{
	"llama-bpe": preLlama3, "llama3": preLlama3, "llama-v3": preLlama3,
	"qwen2": preQwen2,
	"gpt2":  preGPT2, "gpt-2": preGPT2, "default": preGPT2, "": preGPT2,
	"smollm": preDigitsGPT2, "starcoder": preDigitsGPT2,
}

// The SentencePiece ("llama") vocab as tokenizer.json components: spaces
// become "▁", one is put before each stretch of text when add_space_prefix
// is on (llama.cpp does so at the start and after every special token, as
// the Prepend normalizer of Llama 2's tokenizer.json does), and decoding
// undoes both.
const (
	spmPrepend   = `{"type":"Prepend","prepend":"▁"}`
	spmReplace   = `{"type":"Replace","pattern":{"String":" "},"content":"▁"}`
	spmDecode    = `{"type":"Replace","pattern":{"String":"▁"},"content":" "},{"type":"ByteFallback"},{"type":"Fuse"}`
	spmStripLead = `{"type":"Strip","content":" ","start":1,"stop":0}`
)

const maxMergedLen = 64 // see spmMerges

// ggufMeta is the tokenizer.ggml.* metadata, checked.
type ggufMeta struct {
	model, pre     string
	tokens         []string
	types          []int64   // one per token; all normal when the file has none
	scores         []float64 // nil when absent
	merges         []string  // "left right", nil when absent
	bos, eos, unk  int32     // -1 when absent
	eog            []int32   // eot/eom ids, also ending generation
	addBOS, addEOS *bool
	addSpacePrefix *bool
}

// FromGGUF builds the tokenizer described by a GGUF file's tokenizer.ggml.*
// metadata: model "gpt2" (byte-level BPE with merges, split as
// tokenizer.ggml.pre names) or "llama" (SentencePiece BPE with byte
// fallback, merge priority from tokenizer.ggml.scores). Control and
// unknown tokens are special added tokens, user-defined ones plain added
// tokens; BOS/EOS and whether they are added come from the metadata, with
// llama.cpp's defaults.
func FromGGUF(f *gguf.File) (*Tokenizer, error) {
	t, err := fromGGUF(f)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: gguf: %w", err)
	}
	return t, nil
}

func fromGGUF(f *gguf.File) (*Tokenizer, error) {
	m, err := readGGUFMeta(f)
	if err != nil {
		return nil, err
	}
	spec := &fileSpec{}
	ms := &modelSpec{Type: "BPE", Vocab: make(map[string]int64, len(m.tokens))}
	for id, s := range m.tokens {
		// A string given to two ids encodes to the later one, as in
		// llama.cpp; both decode (see below).
		if s != "" {
			ms.Vocab[s] = int64(id)
		}
		switch m.types[id] {
		case ggufControl, ggufUnknown, ggufUserDefined:
			if s == "" {
				continue
			}
			// llama.cpp matches these in the raw text before splitting it.
			id64 := int64(id)
			spec.AddedTokens = append(spec.AddedTokens, addedTokenSpec{
				ID: &id64, Content: s, Special: m.types[id] != ggufUserDefined})
		}
	}
	if m.unk >= 0 {
		ms.UnkToken = &m.tokens[m.unk]
	}
	var merges [][2]string
	var ranks []int32
	addBOS := false
	switch m.model {
	case "gpt2":
		pre, ok := ggufPres[m.pre]
		if !ok {
			return nil, fmt.Errorf("tokenizer.ggml.pre %q is not supported (supported: %s)", m.pre, supportedPres())
		}
		spec.Normalizer = jsonOrNil(pre.normalizer)
		spec.PreTokenizer = []byte(pre.preTokenizer)
		spec.Decoder = []byte(`{"type":"ByteLevel"}`)
		ms.IgnoreMerges = pre.ignoreMerges
		addBOS = pre.addBOS
		if merges, err = ggufMerges(m.merges, ms.Vocab); err != nil {
			return nil, err
		}
	case "llama":
		ms.ByteFallback, ms.FuseUnk = true, true
		prefix := m.addSpacePrefix == nil || *m.addSpacePrefix
		norm, dec := spmReplace, spmDecode
		if prefix {
			norm, dec = spmPrepend+","+spmReplace, spmDecode+","+spmStripLead
		}
		spec.Normalizer = []byte(`{"type":"Sequence","normalizers":[` + norm + `]}`)
		spec.Decoder = []byte(`{"type":"Sequence","decoders":[` + dec + `]}`)
		addBOS = true
		merges, ranks = spmMerges(m, ms.Vocab)
	}
	t, err := build(spec, ms, merges, ranks, &configSpec{})
	if err != nil {
		return nil, err
	}

	// Every id decodes, even one whose string a later id also has (or an
	// empty one, which no encoding yields).
	if grow := len(m.tokens) - len(t.idToToken); grow > 0 {
		t.idToToken = append(t.idToToken, make([]string, grow)...)
		t.hasToken = append(t.hasToken, make([]bool, grow)...)
		t.special = append(t.special, make([]bool, grow)...)
	}
	for id, s := range m.tokens {
		if !t.hasToken[id] {
			t.idToToken[id], t.hasToken[id] = s, true
		}
	}
	if m.addBOS != nil {
		addBOS = *m.addBOS
	} else if m.bos < 0 {
		addBOS = false // only a default: nothing to add
	}
	addEOS := m.addEOS != nil && *m.addEOS
	t.bos, t.eos, t.prefix, t.suffix = m.bos, nil, nil, nil
	if m.eos >= 0 {
		t.eos = append(t.eos, m.eos)
	}
	for _, id := range m.eog {
		if !slices.Contains(t.eos, id) {
			t.eos = append(t.eos, id)
		}
	}
	if addBOS {
		if m.bos < 0 {
			return nil, fmt.Errorf("tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing")
		}
		t.prefix = []int32{m.bos}
	}
	if addEOS {
		if m.eos < 0 {
			return nil, fmt.Errorf("tokenizer.ggml.add_eos_token is true but tokenizer.ggml.eos_token_id is missing")
		}
		t.suffix = []int32{m.eos}
	}
	return t, nil
}

func jsonOrNil(s string) []byte {
	if s == "" {
		return nil
	}
	return []byte(s)
}

func supportedPres() string {
	var names []string
	for n := range ggufPres {
		if n != "" {
			names = append(names, fmt.Sprintf("%q", n))
		}
	}
	slices.Sort(names)
	return strings.Join(names, ", ")
}

// readGGUFMeta reads and checks the tokenizer.ggml.* keys.
func readGGUFMeta(f *gguf.File) (*ggufMeta, error) {
	m := &ggufMeta{}
	var err error
	if m.model, err = ggufString(f, "tokenizer.ggml.model", true); err != nil {
		return nil, err
	}
	if m.model != "gpt2" && m.model != "llama" {
		return nil, fmt.Errorf("tokenizer.ggml.model %q is not supported (want \"gpt2\", byte-level BPE, or \"llama\", SentencePiece BPE)", m.model)
	}
	if m.pre, err = ggufString(f, "tokenizer.ggml.pre", false); err != nil {
		return nil, err
	}

	v, ok := f.Get("tokenizer.ggml.tokens")
	if !ok {
		return nil, fmt.Errorf("tokenizer.ggml.tokens is missing")
	}
	if m.tokens, ok = v.Strings(); !ok {
		return nil, fmt.Errorf("tokenizer.ggml.tokens is %s, not an array of strings", v)
	}
	n := len(m.tokens)
	if n == 0 {
		return nil, fmt.Errorf("tokenizer.ggml.tokens is empty")
	}
	if n > maxTokenID {
		return nil, fmt.Errorf("tokenizer.ggml.tokens has %d tokens, over the limit of %d", n, maxTokenID)
	}

	if v, ok := f.Get("tokenizer.ggml.token_type"); ok {
		if m.types, ok = v.Ints(); !ok {
			return nil, fmt.Errorf("tokenizer.ggml.token_type is %s, not an array of integers", v)
		}
		if len(m.types) != n {
			return nil, fmt.Errorf("tokenizer.ggml.token_type has %d entries for %d tokens", len(m.types), n)
		}
		for i, ty := range m.types {
			if ty < ggufUndefined || ty > ggufByte {
				return nil, fmt.Errorf("tokenizer.ggml.token_type[%d] is %d, not a llama.cpp token type (0 to 6)", i, ty)
			}
		}
	} else {
		m.types = make([]int64, n) // undefined, treated as normal
	}

	if v, ok := f.Get("tokenizer.ggml.scores"); ok {
		if m.scores, ok = v.Floats(); !ok {
			return nil, fmt.Errorf("tokenizer.ggml.scores is %s, not an array of floats", v)
		}
		if len(m.scores) != n {
			return nil, fmt.Errorf("tokenizer.ggml.scores has %d entries for %d tokens", len(m.scores), n)
		}
		for i, s := range m.scores {
			if math.IsNaN(s) {
				return nil, fmt.Errorf("tokenizer.ggml.scores[%d] is NaN", i)
			}
		}
	} else if m.model == "llama" {
		return nil, fmt.Errorf("tokenizer.ggml.scores is missing; a \"llama\" (SentencePiece) vocab needs them to order its merges")
	}

	if v, ok := f.Get("tokenizer.ggml.merges"); ok {
		if m.merges, ok = v.Strings(); !ok {
			return nil, fmt.Errorf("tokenizer.ggml.merges is %s, not an array of strings", v)
		}
	} else if m.model == "gpt2" {
		return nil, fmt.Errorf("tokenizer.ggml.merges is missing; a \"gpt2\" vocab needs them")
	}

	if m.bos, err = ggufID(f, "tokenizer.ggml.bos_token_id", n); err != nil {
		return nil, err
	}
	if m.eos, err = ggufID(f, "tokenizer.ggml.eos_token_id", n); err != nil {
		return nil, err
	}
	if m.unk, err = ggufID(f, "tokenizer.ggml.unknown_token_id", n); err != nil {
		return nil, err
	}
	if m.model == "llama" {
		// llama.cpp's defaults for a SentencePiece vocab, taken only
		// where the vocab agrees: <unk> is its unknown token, <s> and
		// </s> are control tokens 1 and 2.
		if m.unk < 0 {
			m.unk = int32(slices.Index(m.types, ggufUnknown))
		}
		if m.bos < 0 && n > 1 && m.types[1] == ggufControl {
			m.bos = 1
		}
		if m.eos < 0 && n > 2 && m.types[2] == ggufControl {
			m.eos = 2
		}
	}
	if m.unk >= 0 && m.tokens[m.unk] == "" {
		return nil, fmt.Errorf("the unknown token (id %d) is an empty string", m.unk)
	}
	// End-of-turn and end-of-message tokens end generation as EOS does.
	for _, key := range []string{"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"} {
		id, err := ggufID(f, key, n)
		if err != nil {
			return nil, err
		}
		if id >= 0 {
			m.eog = append(m.eog, id)
		}
	}
	// padding_token_id is not read: the tokenizer never pads.

	if m.addBOS, err = ggufBool(f, "tokenizer.ggml.add_bos_token"); err != nil {
		return nil, err
	}
	if m.addEOS, err = ggufBool(f, "tokenizer.ggml.add_eos_token"); err != nil {
		return nil, err
	}
	if m.addSpacePrefix, err = ggufBool(f, "tokenizer.ggml.add_space_prefix"); err != nil {
		return nil, err
	}
	return m, nil
}

func ggufString(f *gguf.File, key string, required bool) (string, error) {
	v, ok := f.Get(key)
	if !ok {
		if required {
			return "", fmt.Errorf("%s is missing", key)
		}
		return "", nil
	}
	s, ok := v.Str()
	if !ok {
		return "", fmt.Errorf("%s is %s (%s), not a string", key, v, v.Type)
	}
	return s, nil
}

// ggufID reads a token id key, -1 when absent; it must name one of the n
// tokens.
func ggufID(f *gguf.File, key string, n int) (int32, error) {
	v, ok := f.Get(key)
	if !ok {
		return -1, nil
	}
	id, ok := v.Uint()
	if !ok || v.Type == gguf.TypeArray {
		return -1, fmt.Errorf("%s is %s (%s), not a token id", key, v, v.Type)
	}
	if id >= uint64(n) {
		return -1, fmt.Errorf("%s is %d, outside the %d tokens", key, id, n)
	}
	return int32(id), nil
}

func ggufBool(f *gguf.File, key string) (*bool, error) {
	v, ok := f.Get(key)
	if !ok {
		return nil, nil
	}
	b, ok := v.BoolValue()
	if !ok {
		return nil, fmt.Errorf("%s is %s (%s), not a bool", key, v, v.Type)
	}
	return &b, nil
}

// ggufMerges splits tokenizer.ggml.merges entries "left right" and checks
// that both sides and their concatenation are tokens.
func ggufMerges(list []string, vocab map[string]int64) ([][2]string, error) {
	out := make([][2]string, len(list))
	for i, s := range list {
		// The left side is never empty, so the separator is the first
		// space after the first byte (a left side may be " " itself).
		j := -1
		if len(s) > 1 {
			j = strings.IndexByte(s[1:], ' ') + 1
		}
		if j <= 0 || j == len(s)-1 {
			return nil, fmt.Errorf("tokenizer.ggml.merges[%d] is %q, not \"left right\"", i, s)
		}
		l, r := s[:j], s[j+1:]
		for _, part := range []string{l, r, l + r} {
			if _, ok := vocab[part]; !ok {
				return nil, fmt.Errorf("tokenizer.ggml.merges[%d] %q: %q is not in tokenizer.ggml.tokens", i, s, part)
			}
		}
		out[i] = [2]string{l, r}
	}
	return out, nil
}

// spmMerges derives BPE merges from a SentencePiece vocab's scores, as
// Hugging Face's SentencePiece converter does: every split of a token
// into two tokens is a merge, and merges producing higher-scored tokens
// come first. llama.cpp's SentencePiece tokenizer merges, again and
// again, the adjacent pair whose concatenation is the best-scored token,
// leftmost first on a tie; BPE over these merges does the same, with
// merges of equally scored tokens sharing a rank so the leftmost wins.
//
// Only tokens the merge loop can reach are results: not control, unknown
// or user-defined tokens (split out of the text before BPE runs) nor byte
// tokens (<0xNN>, used only as fallback). Nor are tokens over
// maxMergedLen bytes: trying every split costs the square of a token's
// length, which a hostile file could make huge, and SentencePiece's
// pieces are 16 characters at most unless trained otherwise.
func spmMerges(m *ggufMeta, vocab map[string]int64) ([][2]string, []int32) {
	type cand struct {
		pair  [2]string
		score float64
	}
	var cands []cand
	for id, s := range m.tokens {
		switch m.types[id] {
		case ggufNormal, ggufUndefined, ggufUnused:
		default:
			continue
		}
		if vocab[s] != int64(id) || len(s) > maxMergedLen { // a repeated string's last id stands
			continue
		}
		for k := 0; k < len(s); {
			_, w := utf8.DecodeRuneInString(s[k:])
			k += w
			if k >= len(s) {
				break
			}
			l, r := s[:k], s[k:]
			if _, ok := vocab[l]; !ok {
				continue
			}
			if _, ok := vocab[r]; !ok {
				continue
			}
			cands = append(cands, cand{[2]string{l, r}, m.scores[id]})
		}
	}
	slices.SortStableFunc(cands, func(a, b cand) int { return cmp.Compare(b.score, a.score) })
	merges := make([][2]string, len(cands))
	ranks := make([]int32, len(cands))
	rank := int32(0)
	for i, c := range cands {
		if i > 0 && c.score != cands[i-1].score {
			rank++
		}
		merges[i], ranks[i] = c.pair, rank
	}
	return merges, ranks
}
