package model

import "encoding/json"

// MarshalHF writes c as a transformers 5 config.json (rope_parameters form).
func (c *Config) MarshalHF() ([]byte, error) {
	rope := map[string]any{"rope_type": c.Rope.Type, "rope_theta": c.Rope.Theta}
	if c.Rope.Type == "llama3" {
		rope["factor"] = c.Rope.Factor
		rope["low_freq_factor"] = c.Rope.LowFreqFactor
		rope["high_freq_factor"] = c.Rope.HighFreqFactor
		rope["original_max_position_embeddings"] = c.Rope.OriginalMaxPos
	}
	m := map[string]any{
		"architectures":           []string{c.Architecture},
		"model_type":              c.ModelType,
		"hidden_size":             c.Hidden,
		"intermediate_size":       c.Intermediate,
		"num_hidden_layers":       c.NumLayers,
		"num_attention_heads":     c.Heads,
		"num_key_value_heads":     c.KVHeads,
		"head_dim":                c.HeadDim,
		"vocab_size":              c.Vocab,
		"rms_norm_eps":            c.RMSEps,
		"rope_parameters":         rope,
		"tie_word_embeddings":     c.TieEmbeddings,
		"hidden_act":              "silu",
		"mlp_bias":                false,
		"max_position_embeddings": c.MaxPositions,
		"bos_token_id":            nil,
		"eos_token_id":            nil,
	}
	if c.ModelType != "mistral" {
		m["attention_bias"] = c.AttentionBias
	}
	if c.SlidingWindow > 0 {
		m["sliding_window"] = c.SlidingWindow
		if c.ModelType == "qwen2" {
			m["use_sliding_window"] = true
		}
	}
	if c.BOS >= 0 {
		m["bos_token_id"] = c.BOS
	}
	switch len(c.EOS) {
	case 0:
	case 1:
		m["eos_token_id"] = c.EOS[0]
	default:
		m["eos_token_id"] = c.EOS
	}
	if c.TorchDType != "" {
		m["dtype"] = c.TorchDType
	}
	return json.MarshalIndent(m, "", "  ")
}
