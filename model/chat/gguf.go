package chat

import (
	"fmt"

	"meshgpu/model/gguf"
)

// FromGGUF compiles the chat template of a GGUF file,
// tokenizer.chat_template (HF's default template; llama.cpp's converter
// writes other named ones under tokenizer.chat_template.<name>, which,
// as with Load, are not read). bos_token and eos_token are the strings of
// the tokens tokenizer.ggml.bos_token_id and eos_token_id name. It
// returns (nil, ErrNoTemplate) when the file has no template.
func FromGGUF(f *gguf.File) (*Template, error) {
	v, ok := f.Get("tokenizer.chat_template")
	if !ok {
		return nil, ErrNoTemplate
	}
	src, ok := v.Str()
	if !ok {
		return nil, fmt.Errorf("chat: gguf: tokenizer.chat_template is %s (%s), not a string", v, v.Type)
	}
	if src == "" {
		return nil, ErrNoTemplate
	}
	bos, err := ggufToken(f, "tokenizer.ggml.bos_token_id")
	if err != nil {
		return nil, err
	}
	eos, err := ggufToken(f, "tokenizer.ggml.eos_token_id")
	if err != nil {
		return nil, err
	}
	return parseNamed(src, bos, eos, "gguf tokenizer.chat_template")
}

// ggufToken is the string of the token a metadata key names, "" when the
// key is absent.
func ggufToken(f *gguf.File, key string) (string, error) {
	v, ok := f.Get(key)
	if !ok {
		return "", nil
	}
	id, ok := v.Uint()
	if !ok || v.Type == gguf.TypeArray {
		return "", fmt.Errorf("chat: gguf: %s is %s (%s), not a token id", key, v, v.Type)
	}
	tv, _ := f.Get("tokenizer.ggml.tokens")
	tokens, _ := tv.Strings()
	if id >= uint64(len(tokens)) {
		return "", fmt.Errorf("chat: gguf: %s is %d, outside the %d tokens of tokenizer.ggml.tokens", key, id, len(tokens))
	}
	return tokens[id], nil
}
