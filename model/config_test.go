package model

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
)

func TestConfigBothFormsEqual(t *testing.T) {
	dir := testenv.GoCoder(t)
	cur, err := LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	legacy, err := LoadConfig(filepath.Join(dir, "legacy"))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(cur, legacy) {
		t.Fatalf("rope_parameters form and legacy form differ:\n%+v\n%+v", cur, legacy)
	}
	// Independent reference: the raw JSON fields.
	var raw map[string]any
	data, _ := os.ReadFile(filepath.Join(dir, "config.json"))
	if err := json.Unmarshal(data, &raw); err != nil {
		t.Fatal(err)
	}
	num := func(k string) int { return int(raw[k].(float64)) }
	rp := raw["rope_parameters"].(map[string]any)
	want := Config{
		Architecture: "LlamaForCausalLM", ModelType: "llama",
		Hidden: num("hidden_size"), Intermediate: num("intermediate_size"), NumLayers: num("num_hidden_layers"),
		Heads: num("num_attention_heads"), KVHeads: num("num_key_value_heads"), HeadDim: num("head_dim"),
		Vocab: num("vocab_size"), RMSEps: raw["rms_norm_eps"].(float64),
		Rope: RopeConfig{Type: rp["rope_type"].(string), Theta: rp["rope_theta"].(float64), Factor: rp["factor"].(float64),
			LowFreqFactor: rp["low_freq_factor"].(float64), HighFreqFactor: rp["high_freq_factor"].(float64),
			OriginalMaxPos: int(rp["original_max_position_embeddings"].(float64))},
		TieEmbeddings: raw["tie_word_embeddings"].(bool), MaxPositions: num("max_position_embeddings"),
		BOS: num("bos_token_id"), EOS: []int{num("eos_token_id")}, TorchDType: "bfloat16",
	}
	if !reflect.DeepEqual(*cur, want) {
		t.Fatalf("config\n got %+v\nwant %+v", *cur, want)
	}
}

// base is a plain Llama config with only the required fields.
const base = `{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":64,"intermediate_size":128,
"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100`

func TestConfigHFDefaults(t *testing.T) {
	c, err := ParseConfig([]byte(base + `}`))
	if err != nil {
		t.Fatal(err)
	}
	// LlamaConfig's defaults.
	if c.HeadDim != 16 || c.KVHeads != 4 || c.RMSEps != 1e-6 || c.Rope != (RopeConfig{Type: "default", Theta: 10000}) ||
		c.BOS != -1 || len(c.EOS) != 0 || c.TieEmbeddings || c.AttentionBias || c.MaxPositions != 2048 {
		t.Fatalf("defaults not applied: %+v", c)
	}
}

func TestConfigVariants(t *testing.T) {
	cases := []struct {
		name, json string
		check      func(c *Config) bool
	}{
		{"qwen2 has qkv bias", `{"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","hidden_size":896,"intermediate_size":4864,
			"num_hidden_layers":24,"num_attention_heads":14,"num_key_value_heads":2,"vocab_size":151936,"rope_theta":1000000.0,
			"rms_norm_eps":1e-06,"tie_word_embeddings":true,"sliding_window":32768,"use_sliding_window":false,"max_window_layers":21,
			"bos_token_id":151643,"eos_token_id":151643,"max_position_embeddings":32768,"torch_dtype":"bfloat16","rope_scaling":null}`,
			func(c *Config) bool {
				return c.AttentionBias && c.HeadDim == 64 && c.Rope.Theta == 1e6 && c.Rope.Type == "default" && c.SlidingWindow == 0 &&
					c.TieEmbeddings && c.BOS == 151643
			}},
		{"mistral sliding window", `{"architectures":["MistralForCausalLM"],"model_type":"mistral","hidden_size":4096,"intermediate_size":14336,
			"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":32000,"rope_theta":10000.0,
			"rms_norm_eps":1e-05,"sliding_window":4096,"bos_token_id":1,"eos_token_id":2,"max_position_embeddings":32768}`,
			func(c *Config) bool {
				return c.SlidingWindow == 4096 && c.HeadDim == 128 && !c.AttentionBias && c.ModelType == "mistral"
			}},
		{"legacy rope_scaling with type", base + `,"rope_theta":500000,"rope_scaling":{"type":"llama3","factor":32.0,"low_freq_factor":1.0,
			"high_freq_factor":4.0,"original_max_position_embeddings":8192}}`,
			func(c *Config) bool {
				return c.Rope == RopeConfig{Type: "llama3", Theta: 500000, Factor: 32, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPos: 8192}
			}},
		{"eos list, null bos, head_dim given", base + `,"eos_token_id":[7,8,9],"bos_token_id":null,"head_dim":32,"num_key_value_heads":null}`,
			func(c *Config) bool {
				return reflect.DeepEqual(c.EOS, []int{7, 8, 9}) && c.BOS == -1 && c.HeadDim == 32 && c.KVHeads == 4
			}},
		{"model_type from architectures", `{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
			"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100}`,
			func(c *Config) bool { return c.ModelType == "llama" }},
		{"rope_parameters default", base + `,"rope_parameters":{"rope_type":"default","rope_theta":1234.5}}`,
			func(c *Config) bool { return c.Rope == RopeConfig{Type: "default", Theta: 1234.5} }},
	}
	for _, tc := range cases {
		c, err := ParseConfig([]byte(tc.json))
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if !tc.check(c) {
			t.Errorf("%s: wrong config %+v", tc.name, c)
		}
	}
}

func TestConfigBadInput(t *testing.T) {
	cases := []struct{ json, want string }{
		{`{"architectures":["MixtralForCausalLM"],"model_type":"mixtral","hidden_size":64}`, `unsupported architecture "MixtralForCausalLM"`},
		{`{"architectures":["GPT2LMHeadModel"],"model_type":"gpt2"}`, "supported: LlamaForCausalLM"},
		{`{"architectures":["MistralForCausalLM"],"model_type":"llama"}`, "unsupported architecture"},
		{base + `,"num_key_value_heads":3}`, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"},
		{base + `,"num_key_value_heads":0}`, "num_key_value_heads must be > 0"},
		{strings.Replace(base, `"hidden_size":64`, `"hidden_size":66`, 1) + `}`, "hidden_size 66 is not divisible by num_attention_heads 4"},
		{strings.Replace(base, `"hidden_size":64`, `"hidden_size":-64`, 1) + `,"head_dim":16}`, "hidden_size must be > 0"},
		{strings.Replace(base, `"vocab_size":100`, `"vocab_size":0`, 1) + `}`, "vocab_size must be > 0"},
		{strings.Replace(base, `"num_hidden_layers":2`, `"num_hidden_layers":1e9`, 1) + `}`, "num_hidden_layers"},
		{base + `,"head_dim":15}`, "head_dim 15 must be even"},
		{base + `,"rope_scaling":{"rope_type":"linear","factor":2.0}}`, `unsupported rope_type "linear"`},
		{base + `,"rope_parameters":{"rope_type":"yarn","factor":2.0}}`, `unsupported rope_type "yarn"`},
		{base + `,"rope_parameters":{"rope_type":"llama3","rope_theta":500000}}`, "llama3 rope needs factor"},
		{base + `,"rope_parameters":{"rope_type":"llama3","factor":8,"low_freq_factor":4,"high_freq_factor":1,"original_max_position_embeddings":8192}}`, "low_freq_factor < high_freq_factor"},
		{base + `,"rope_theta":-1}`, "rope_theta must be > 0"},
		{base + `,"rms_norm_eps":0}`, "rms_norm_eps"},
		{base + `,"eos_token_id":100}`, "eos_token_id 100 is outside the vocabulary"},
		{base + `,"eos_token_id":"x"}`, "eos_token_id: want an integer"},
		{base + `,"bos_token_id":-5}`, "bos_token_id -5"},
		{base + `,"hidden_act":"gelu"}`, `hidden_act "gelu"`},
		{base + `,"attention_bias":true}`, "attention_bias"},
		{base + `,"mlp_bias":true}`, "mlp_bias"},
		{base + `,"quantization_config":{"quant_method":"gptq"}}`, "quantized"},
		{`[1,2,3]`, "not a valid config.json"},
		{`{"hidden_size": "big"`, "not a valid config.json"},
		{``, "not a valid config.json"},
	}
	for _, tc := range cases {
		_, err := ParseConfig([]byte(tc.json))
		if err == nil {
			t.Errorf("%s: no error, want %q", tc.json, tc.want)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s:\n error %q\n  want %q on one line", tc.json, err, tc.want)
		}
	}
}

func TestLoadConfigNamesFile(t *testing.T) {
	dir := t.TempDir()
	if _, err := LoadConfig(dir); err == nil || !strings.Contains(err.Error(), "config.json") {
		t.Fatalf("missing config: %v", err)
	}
	os.WriteFile(filepath.Join(dir, "config.json"), []byte(base+`,"num_key_value_heads":3}`), 0o644)
	_, err := LoadConfig(dir)
	if err == nil || !strings.Contains(err.Error(), filepath.Join(dir, "config.json")) || !strings.Contains(err.Error(), "num_key_value_heads") {
		t.Fatalf("inconsistent heads: %v", err)
	}
}

// The byte counts must agree with what the real checkpoint stores.
func TestByteCountsMatchCheckpoint(t *testing.T) {
	dir := testenv.GoCoder(t)
	cfg, err := LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	ck, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	for layer := 0; layer < cfg.NumLayers; layer++ {
		var n int64
		for _, name := range ck.Names() {
			if strings.HasPrefix(name, LayerTensorName(layer, "")) {
				tt, _ := ck.Tensor(name)
				n += int64(len(tt.Data))
			}
		}
		if n != cfg.LayerBytes(BF16) {
			t.Errorf("layer %d: checkpoint holds %d bytes, LayerBytes says %d", layer, n, cfg.LayerBytes(BF16))
		}
	}
	emb, _ := ck.Tensor(EmbedName)
	if int64(len(emb.Data)) != cfg.EmbedBytes(BF16) || cfg.HeadBytes(BF16) != 0 {
		t.Errorf("embed bytes %d vs %d, head %d (tied)", len(emb.Data), cfg.EmbedBytes(BF16), cfg.HeadBytes(BF16))
	}
	var total int64
	for _, name := range ck.Names() {
		tt, _ := ck.Tensor(name)
		total += int64(len(tt.Data))
	}
	if total != cfg.TotalBytes(BF16) {
		t.Errorf("checkpoint holds %d bytes, TotalBytes says %d", total, cfg.TotalBytes(BF16))
	}
	// K and V, 2 KV heads x head_dim 32, 2 bytes each (DESIGN.md's shape).
	if got := cfg.KVBytesPerToken(BF16); got != 2*2*32*2 {
		t.Errorf("KVBytesPerToken = %d", got)
	}
	if got := cfg.KVBytesPerToken(F32); got != 2*2*32*4 {
		t.Errorf("KVBytesPerToken(F32) = %d", got)
	}
}
