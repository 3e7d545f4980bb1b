package model

import (
	"fmt"
	"strconv"
	"strings"
)

// Tensor names of the Hugging Face Llama layout, shared by Llama, Mistral and
// Qwen2 checkpoints.
const (
	EmbedName     = "model.embed_tokens.weight"
	FinalNormName = "model.norm.weight"
	LMHeadName    = "lm_head.weight"
)

// Suffixes of per-layer tensors; LayerTensorName joins them to a layer index.
const (
	AttnNorm = "input_layernorm.weight"
	QProj    = "self_attn.q_proj.weight"
	KProj    = "self_attn.k_proj.weight"
	VProj    = "self_attn.v_proj.weight"
	QBias    = "self_attn.q_proj.bias"
	KBias    = "self_attn.k_proj.bias"
	VBias    = "self_attn.v_proj.bias"
	OProj    = "self_attn.o_proj.weight"
	MLPNorm  = "post_attention_layernorm.weight"
	GateProj = "mlp.gate_proj.weight"
	UpProj   = "mlp.up_proj.weight"
	DownProj = "mlp.down_proj.weight"
)

// LayerTensorName is the checkpoint name of a per-layer tensor:
// "model.layers.<layer>.<suffix>".
func LayerTensorName(layer int, suffix string) string {
	return "model.layers." + strconv.Itoa(layer) + "." + suffix
}

// ParseLayers reads a layer range "a-b" (inclusive) or a single layer "a" and
// checks it against a model of numLayers layers.
func ParseLayers(s string, numLayers int) (first, last int, err error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, 0, fmt.Errorf("empty layer range (want a-b or a, e.g. 0-%d)", numLayers-1)
	}
	a, b, isRange := strings.Cut(s, "-")
	first, err = parseLayerIndex(a)
	if err != nil {
		return 0, 0, fmt.Errorf("layer range %q: %w (want a-b or a, e.g. 0-%d)", s, err, numLayers-1)
	}
	last = first
	if isRange {
		if last, err = parseLayerIndex(b); err != nil {
			return 0, 0, fmt.Errorf("layer range %q: %w (want a-b or a, e.g. 0-%d)", s, err, numLayers-1)
		}
	}
	if first > last {
		return 0, 0, fmt.Errorf("layer range %q is reversed: first layer %d is after last layer %d", s, first, last)
	}
	if last >= numLayers {
		return 0, 0, fmt.Errorf("layer range %q is beyond the model: it has %d layers (0-%d)", s, numLayers, numLayers-1)
	}
	return first, last, nil
}

func parseLayerIndex(s string) (int, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, fmt.Errorf("missing layer number")
	}
	for _, r := range s {
		if r < '0' || r > '9' {
			return 0, fmt.Errorf("%q is not a layer number", s)
		}
	}
	n, err := strconv.Atoi(s)
	if err != nil || n > 1<<20 {
		return 0, fmt.Errorf("layer number %q is too large", s)
	}
	return n, nil
}
