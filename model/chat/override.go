package chat

import (
	"fmt"
	"os"
)

// LoadFile compiles the template in path to replace a model's own
// (`meshgpu run --chat-template-file`, as llama-server's and vLLM's): it
// keeps the bos_token and eos_token of base, the model's template, when it
// has one (base may be nil).
func LoadFile(path string, base *Template) (*Template, error) {
	src, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("chat: %w", err)
	}
	var bos, eos string
	if base != nil {
		bos, eos = base.bosToken, base.eosToken
	}
	return parseNamed(string(src), bos, eos, path)
}
