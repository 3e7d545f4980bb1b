package model

import (
	"encoding/json"
	"fmt"
	"meshgpu/model/tokenizer"
)

// The synthesized tokenizer is byte-level BPE in the Llama 3 layout: the 256
// byte tokens, a few merges, and two special tokens, so a random model
// directory loads in every tokenizer that reads tokenizer.json.

const (
	SynthBOS = "<|begin_of_text|>"
	SynthEOS = "<|end_of_text|>"
)

// llama3Split is the Llama 3 pre-tokenizer regex.
const llama3Split = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`

// synthMerges are merges of plain text; each part is a byte or an earlier merge.
var synthMerges = [][2]string{
	{" ", "t"}, {"h", "e"}, {" t", "he"}, {"i", "n"}, {"e", "r"}, {"o", "n"},
	{" ", "a"}, {"r", "e"}, {"a", "t"}, {"e", "n"}, {"in", "g"}, {" ", "s"},
	{"o", "r"}, {" ", "w"}, {"e", "s"}, {" ", " "}, {"  ", "  "}, {"f", "u"},
	{"fu", "n"}, {"fun", "c"},
}

// synthTokenizerSize is the number of token ids the synthesized tokenizer uses.
var synthTokenizerSize = 256 + len(synthMerges) + 2

// synthSpecialIDs are the ids of the BOS and EOS tokens.
func synthSpecialIDs() (bos, eos int) {
	return 256 + len(synthMerges), 256 + len(synthMerges) + 1
}

// synthTokenizerJSON builds tokenizer.json.
func synthTokenizerJSON() ([]byte, error) {
	vocab := map[string]int{}
	for b := 0; b < 256; b++ {
		vocab[tokenizer.ByteLevel(string([]byte{byte(b)}))] = b
	}
	merges := make([][2]string, len(synthMerges))
	for i, m := range synthMerges {
		a, b := tokenizer.ByteLevel(m[0]), tokenizer.ByteLevel(m[1])
		if _, ok := vocab[a]; !ok {
			return nil, fmt.Errorf("synth merge %d: %q is not in the vocabulary", i, m[0])
		}
		if _, ok := vocab[b]; !ok {
			return nil, fmt.Errorf("synth merge %d: %q is not in the vocabulary", i, m[1])
		}
		merges[i] = [2]string{a, b}
		vocab[a+b] = 256 + i
	}
	bos, eos := synthSpecialIDs()
	vocab[SynthBOS], vocab[SynthEOS] = bos, eos
	added := func(id int, content string) map[string]any {
		return map[string]any{"id": id, "content": content, "single_word": false, "lstrip": false,
			"rstrip": false, "normalized": false, "special": true}
	}
	tok := map[string]any{
		"version":      "1.0",
		"truncation":   nil,
		"padding":      nil,
		"added_tokens": []any{added(bos, SynthBOS), added(eos, SynthEOS)},
		"normalizer":   nil,
		"pre_tokenizer": map[string]any{"type": "Sequence", "pretokenizers": []any{
			map[string]any{"type": "Split", "pattern": map[string]any{"Regex": llama3Split}, "behavior": "Isolated", "invert": false},
			map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
		}},
		"post_processor": map[string]any{
			"type":   "TemplateProcessing",
			"single": []any{map[string]any{"SpecialToken": map[string]any{"id": SynthBOS, "type_id": 0}}, map[string]any{"Sequence": map[string]any{"id": "A", "type_id": 0}}},
			"pair": []any{map[string]any{"SpecialToken": map[string]any{"id": SynthBOS, "type_id": 0}}, map[string]any{"Sequence": map[string]any{"id": "A", "type_id": 0}},
				map[string]any{"SpecialToken": map[string]any{"id": SynthBOS, "type_id": 1}}, map[string]any{"Sequence": map[string]any{"id": "B", "type_id": 1}}},
			"special_tokens": map[string]any{SynthBOS: map[string]any{"id": SynthBOS, "ids": []int{bos}, "tokens": []string{SynthBOS}}},
		},
		"decoder": map[string]any{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
		"model": map[string]any{
			"type": "BPE", "dropout": nil, "unk_token": nil, "continuing_subword_prefix": nil,
			"end_of_word_suffix": nil, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
			"vocab": vocab, "merges": merges,
		},
	}
	return json.MarshalIndent(tok, "", "  ")
}

// synthChatTemplate is a plain "role: content" template using only the two
// special tokens the synthesized tokenizer has.
const synthChatTemplate = "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"

func synthTokenizerConfigJSON(maxLen int) ([]byte, error) {
	return json.MarshalIndent(map[string]any{
		"bos_token":                    SynthBOS,
		"eos_token":                    SynthEOS,
		"add_bos_token":                true,
		"add_eos_token":                false,
		"clean_up_tokenization_spaces": false,
		"model_max_length":             maxLen,
		"tokenizer_class":              "PreTrainedTokenizerFast",
		"chat_template":                synthChatTemplate,
	}, "", "  ")
}
