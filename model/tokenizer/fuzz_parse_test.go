package tokenizer

import (
	"testing"
)

// FuzzParse feeds mutated tokenizer.json files to the loader: it must
// return an error or a tokenizer that encodes and decodes without
// panicking.
func FuzzParse(f *testing.F) {
	for _, s := range parseSeeds {
		f.Add(s)
	}
	f.Fuzz(fuzzParse)
}

// parseSeeds are small tokenizer.json files touching most component types.
var parseSeeds = []string{
	`{"model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2,"<unk>":3,"▁":5,"<0x41>":6},"merges":["a b"],"unk_token":"<unk>","byte_fallback":true,"fuse_unk":true},` +
		`"added_tokens":[{"id":4,"content":"<s>","special":true,"lstrip":true,"rstrip":true}],` +
		`"normalizer":{"type":"Sequence","normalizers":[{"type":"Prepend","prepend":"▁"},{"type":"Replace","pattern":{"String":" "},"content":"▁"}]},` +
		`"pre_tokenizer":null,` +
		`"post_processor":{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<s>","type_id":0}},{"Sequence":{"id":"A","type_id":0}}],"special_tokens":{"<s>":{"id":"<s>","ids":[4],"tokens":["<s>"]}}},` +
		`"decoder":{"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":"▁"},"content":" "},{"type":"ByteFallback"},{"type":"Fuse"},{"type":"Strip","content":" ","start":1,"stop":0}]}}`,
	`{"model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2,"Ġ":3,"Ġa":4},"merges":[["a","b"],["Ġ","a"]],"ignore_merges":true},` +
		`"added_tokens":[{"id":5,"content":"<|x|>","special":true,"single_word":true,"normalized":true}],` +
		`"normalizer":{"type":"NFC"},` +
		`"pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"\\s+(?!\\S)|\\p{L}+"},"behavior":"Isolated","invert":false},{"type":"Metaspace","replacement":"▁","prepend_scheme":"first","split":true},{"type":"ByteLevel","add_prefix_space":true,"use_regex":true}]},` +
		`"post_processor":{"type":"Sequence","processors":[{"type":"ByteLevel"},{"type":"RobertaProcessing","sep":["b",1],"cls":["a",0]}]},` +
		`"decoder":{"type":"ByteLevel"}}`,
}

func TestParseSeeds(t *testing.T) {
	for i, s := range parseSeeds {
		tok, err := parse([]byte(s), nil)
		if err != nil {
			t.Fatalf("seed %d: %v", i, err)
		}
		fuzzParse(t, s)
		if ids := tok.Encode("ab", true); len(ids) < 2 {
			t.Fatalf("seed %d: Encode(ab) = %v", i, ids)
		}
	}
}

func fuzzParse(t *testing.T, doc string) {
	tok, err := parse([]byte(doc), nil)
	if err != nil {
		return
	}
	exercise(t, tok)
}

// exercise encodes, decodes and streams a fuzzed tokenizer: ids must stay
// in the vocab and nothing may panic.
func exercise(t *testing.T, tok *Tokenizer) {
	for _, s := range []string{"ab <s> ba", "", " a\u00a0<|x|>\xff"} {
		ids := tok.Encode(s, true)
		for _, id := range ids {
			if id < 0 || int(id) >= tok.VocabSize() {
				t.Fatalf("Encode gave id %d outside [0, %d)", id, tok.VocabSize())
			}
		}
		tok.Decode(ids, false)
	}
	all := make([]int32, min(tok.VocabSize(), 4096))
	for i := range all {
		all[i] = int32(i)
	}
	tok.Decode(all, true)
	d := tok.NewStreamDecoder(false)
	for _, id := range all[:min(len(all), 64)] {
		d.Add(id)
	}
	d.Flush()
}
