package model

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
)

// RopeConfig holds the rotary embedding parameters.
type RopeConfig struct {
	Type                                  string // "default" or "llama3"
	Theta                                 float64
	Factor, LowFreqFactor, HighFreqFactor float64 // llama3 only
	OriginalMaxPos                        int     // llama3 only
}

// Config is the part of a Hugging Face config.json that the forward pass and
// the shard planner need, with HF's defaults applied.
type Config struct {
	Architecture string // e.g. "LlamaForCausalLM"
	ModelType    string // "llama", "mistral", "qwen2"
	Hidden       int
	Intermediate int
	NumLayers    int
	Heads        int
	KVHeads      int
	HeadDim      int
	Vocab        int
	RMSEps       float64
	Rope         RopeConfig
	// RopeFreqFactors divide the rotary frequencies after Rope's scaling:
	// a GGUF file's rope_freqs tensor, head_dim/2 values; nil for none.
	RopeFreqFactors []float32
	TieEmbeddings   bool
	AttentionBias   bool // q/k/v biases (Qwen2 always)
	MaxPositions    int
	BOS             int   // -1 when absent
	EOS             []int // empty when absent
	TorchDType      string
	// SlidingWindow is Mistral's sliding_window, or Qwen2's when
	// use_sliding_window is set; 0 when none. The backends attend over the
	// whole context, which matches HF only up to this many positions.
	SlidingWindow int
}

// architectures maps each supported model_type to its HF class.
var architectures = map[string]string{
	"llama":   "LlamaForCausalLM",
	"mistral": "MistralForCausalLM",
	"qwen2":   "Qwen2ForCausalLM",
}

// maxPositionDefaults are the HF config classes' max_position_embeddings defaults.
var maxPositionDefaults = map[string]int{"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}

func supportedList() string {
	return "LlamaForCausalLM (llama), MistralForCausalLM (mistral), Qwen2ForCausalLM (qwen2)"
}

// rawConfig is config.json as written; pointers tell absent from zero.
type rawConfig struct {
	Architectures      []string        `json:"architectures"`
	ModelType          string          `json:"model_type"`
	Hidden             int             `json:"hidden_size"`
	Intermediate       int             `json:"intermediate_size"`
	NumLayers          int             `json:"num_hidden_layers"`
	Heads              int             `json:"num_attention_heads"`
	KVHeads            *int            `json:"num_key_value_heads"`
	HeadDim            *int            `json:"head_dim"`
	Vocab              int             `json:"vocab_size"`
	RMSEps             *float64        `json:"rms_norm_eps"`
	RopeTheta          *float64        `json:"rope_theta"`
	RopeScaling        json.RawMessage `json:"rope_scaling"`
	RopeParameters     json.RawMessage `json:"rope_parameters"`
	TieEmbeddings      *bool           `json:"tie_word_embeddings"`
	AttentionBias      *bool           `json:"attention_bias"`
	MLPBias            *bool           `json:"mlp_bias"`
	HiddenAct          string          `json:"hidden_act"`
	MaxPositions       *int            `json:"max_position_embeddings"`
	BOS                json.RawMessage `json:"bos_token_id"`
	EOS                json.RawMessage `json:"eos_token_id"`
	TorchDType         string          `json:"torch_dtype"`
	DType              string          `json:"dtype"` // transformers 5 name of torch_dtype
	SlidingWindow      *int            `json:"sliding_window"`
	UseSlidingWindow   *bool           `json:"use_sliding_window"`
	QuantizationConfig json.RawMessage `json:"quantization_config"`
}

// rawRope is rope_parameters (transformers 5) or rope_scaling (legacy, which
// may spell rope_type as "type").
type rawRope struct {
	RopeType       string   `json:"rope_type"`
	Type           string   `json:"type"`
	RopeTheta      *float64 `json:"rope_theta"`
	Factor         *float64 `json:"factor"`
	LowFreqFactor  *float64 `json:"low_freq_factor"`
	HighFreqFactor *float64 `json:"high_freq_factor"`
	OriginalMaxPos *int     `json:"original_max_position_embeddings"`
}

// LoadConfig reads and validates dir/config.json, or the metadata of dir
// when it is a GGUF file.
func LoadConfig(dir string) (*Config, error) {
	if IsGGUF(dir) {
		g, err := openGGUF(dir)
		if err != nil {
			return nil, err
		}
		defer g.close()
		c, err := g.config()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", dir, err)
		}
		return c, nil
	}
	path := filepath.Join(dir, "config.json")
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("model config: %w", err)
	}
	c, err := ParseConfig(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// ParseConfig parses and validates the bytes of a config.json.
func ParseConfig(data []byte) (*Config, error) {
	if len(data) > 16<<20 {
		return nil, fmt.Errorf("config is %d bytes, more than a config.json can sensibly be", len(data))
	}
	var r rawConfig
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, fmt.Errorf("not a valid config.json: %v", err)
	}
	c := &Config{ModelType: r.ModelType, BOS: -1, EOS: []int{}}
	if len(r.Architectures) > 0 {
		c.Architecture = r.Architectures[0]
	}
	if c.ModelType == "" {
		for mt, arch := range architectures {
			if arch == c.Architecture {
				c.ModelType = mt
			}
		}
	}
	if err := checkArchitecture(c.Architecture, c.ModelType); err != nil {
		return nil, err
	}
	if c.Architecture == "" {
		c.Architecture = architectures[c.ModelType]
	}
	if len(r.QuantizationConfig) > 0 && string(r.QuantizationConfig) != "null" {
		return nil, errors.New("quantized checkpoints (quantization_config) are not supported; use a bf16, f16 or f32 checkpoint")
	}
	if r.HiddenAct != "" && r.HiddenAct != "silu" {
		return nil, fmt.Errorf("hidden_act %q is not supported (only silu)", r.HiddenAct)
	}
	if r.MLPBias != nil && *r.MLPBias {
		return nil, errors.New("mlp_bias true is not supported")
	}

	c.Hidden, c.Intermediate, c.NumLayers, c.Heads, c.Vocab = r.Hidden, r.Intermediate, r.NumLayers, r.Heads, r.Vocab
	c.KVHeads = c.Heads
	if r.KVHeads != nil {
		c.KVHeads = *r.KVHeads
	}
	if r.HeadDim != nil {
		c.HeadDim = *r.HeadDim
	} else if c.Heads > 0 {
		if c.Hidden%c.Heads != 0 {
			return nil, fmt.Errorf("hidden_size %d is not divisible by num_attention_heads %d (and head_dim is not given)", c.Hidden, c.Heads)
		}
		c.HeadDim = c.Hidden / c.Heads
	}
	c.RMSEps = 1e-6
	if r.RMSEps != nil {
		c.RMSEps = *r.RMSEps
	}
	c.TieEmbeddings = r.TieEmbeddings != nil && *r.TieEmbeddings
	switch c.ModelType {
	case "qwen2":
		c.AttentionBias = true // Qwen2 always has q/k/v biases
		if r.UseSlidingWindow != nil && *r.UseSlidingWindow && r.SlidingWindow != nil {
			c.SlidingWindow = *r.SlidingWindow
		}
	case "llama":
		// Llama's attention_bias also puts a bias on o_proj, which the
		// backends do not have; refuse rather than compute something else.
		if r.AttentionBias != nil && *r.AttentionBias {
			return nil, errors.New("attention_bias true (with an o_proj bias) is not supported for llama")
		}
	case "mistral":
		if r.SlidingWindow != nil {
			c.SlidingWindow = *r.SlidingWindow
		}
	}
	c.MaxPositions = maxPositionDefaults[c.ModelType]
	if r.MaxPositions != nil {
		c.MaxPositions = *r.MaxPositions
	}
	var err error
	if c.Rope, err = parseRope(&r); err != nil {
		return nil, err
	}
	if c.BOS, err = parseTokenIDs("bos_token_id", r.BOS, true); err != nil {
		return nil, err
	}
	eos, err := parseTokenList("eos_token_id", r.EOS)
	if err != nil {
		return nil, err
	}
	c.EOS = eos
	c.TorchDType = r.TorchDType
	if c.TorchDType == "" {
		c.TorchDType = r.DType
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}

func checkArchitecture(arch, modelType string) error {
	want, ok := architectures[modelType]
	if !ok || (arch != "" && arch != want) {
		name := arch
		if name == "" {
			name = modelType
		}
		return fmt.Errorf("unsupported architecture %q (model_type %q); supported: %s", name, modelType, supportedList())
	}
	return nil
}

func parseRope(r *rawConfig) (RopeConfig, error) {
	rope := RopeConfig{Type: "default", Theta: 10000}
	if r.RopeTheta != nil {
		rope.Theta = *r.RopeTheta
	}
	field, raw := "rope_parameters", r.RopeParameters
	if isNull(raw) {
		field, raw = "rope_scaling", r.RopeScaling
	}
	if isNull(raw) {
		return rope, nil
	}
	var p rawRope
	if err := json.Unmarshal(raw, &p); err != nil {
		return rope, fmt.Errorf("%s: %v", field, err)
	}
	if p.RopeTheta != nil {
		rope.Theta = *p.RopeTheta
	}
	typ := p.RopeType
	if typ == "" {
		typ = p.Type
	}
	switch typ {
	case "", "default":
		return rope, nil
	case "llama3":
		rope.Type = "llama3"
		missing := []string{}
		get := func(name string, v *float64) float64 {
			if v == nil {
				missing = append(missing, name)
				return 0
			}
			return *v
		}
		rope.Factor = get("factor", p.Factor)
		rope.LowFreqFactor = get("low_freq_factor", p.LowFreqFactor)
		rope.HighFreqFactor = get("high_freq_factor", p.HighFreqFactor)
		if p.OriginalMaxPos == nil {
			missing = append(missing, "original_max_position_embeddings")
		} else {
			rope.OriginalMaxPos = *p.OriginalMaxPos
		}
		if len(missing) > 0 {
			return rope, fmt.Errorf("%s: llama3 rope needs %s", field, strings.Join(missing, ", "))
		}
		return rope, nil
	}
	return rope, fmt.Errorf("%s: unsupported rope_type %q (supported: default, llama3)", field, typ)
}

func isNull(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) == 0 || string(t) == "null"
}

// parseTokenIDs reads a token id that may be absent or null (-1 then).
func parseTokenIDs(field string, raw json.RawMessage, allowList bool) (int, error) {
	ids, err := parseTokenList(field, raw)
	if err != nil {
		return 0, err
	}
	if len(ids) == 0 {
		return -1, nil
	}
	if len(ids) > 1 && !allowList {
		return 0, fmt.Errorf("%s: want one id, got %d", field, len(ids))
	}
	return ids[0], nil
}

// parseTokenList reads an id field that may be absent, null, an int or a list.
func parseTokenList(field string, raw json.RawMessage) ([]int, error) {
	if isNull(raw) {
		return []int{}, nil
	}
	var one int
	if err := json.Unmarshal(raw, &one); err == nil {
		return []int{one}, nil
	}
	var many []int
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, fmt.Errorf("%s: want an integer or a list of integers, got %s", field, truncate(string(raw), 40))
	}
	return many, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// Size caps that keep every byte count far from int64 overflow; real models
// are orders of magnitude below them.
const (
	maxDim    = 1 << 20
	maxLayers = 1 << 12
	maxVocab  = 1 << 24
)

// Validate checks that the sizes are positive and consistent.
func (c *Config) Validate() error {
	if err := checkArchitecture(c.Architecture, c.ModelType); err != nil {
		return err
	}
	sizes := []struct {
		name string
		v    int
		max  int
	}{
		{"hidden_size", c.Hidden, maxDim},
		{"intermediate_size", c.Intermediate, maxDim},
		{"num_hidden_layers", c.NumLayers, maxLayers},
		{"num_attention_heads", c.Heads, maxDim},
		{"num_key_value_heads", c.KVHeads, maxDim},
		{"head_dim", c.HeadDim, maxDim},
		{"vocab_size", c.Vocab, maxVocab},
		{"max_position_embeddings", c.MaxPositions, 1 << 30},
	}
	for _, s := range sizes {
		if s.v <= 0 {
			return fmt.Errorf("%s must be > 0, got %d (missing from config.json?)", s.name, s.v)
		}
		if s.v > s.max {
			return fmt.Errorf("%s %d is larger than the supported %d", s.name, s.v, s.max)
		}
	}
	if c.Heads%c.KVHeads != 0 {
		return fmt.Errorf("inconsistent head counts: num_attention_heads %d is not a multiple of num_key_value_heads %d", c.Heads, c.KVHeads)
	}
	if c.HeadDim%2 != 0 {
		return fmt.Errorf("head_dim %d must be even (RoPE rotates pairs)", c.HeadDim)
	}
	if int64(c.Heads)*int64(c.HeadDim) > maxDim {
		return fmt.Errorf("num_attention_heads %d x head_dim %d is larger than the supported %d", c.Heads, c.HeadDim, maxDim)
	}
	if !(c.RMSEps > 0 && c.RMSEps < 1) {
		return fmt.Errorf("rms_norm_eps must be in (0, 1), got %g", c.RMSEps)
	}
	if err := c.Rope.validate(); err != nil {
		return err
	}
	if c.BOS < -1 || c.BOS >= c.Vocab {
		return fmt.Errorf("bos_token_id %d is outside the vocabulary (vocab_size %d)", c.BOS, c.Vocab)
	}
	for _, id := range c.EOS {
		if id < 0 || id >= c.Vocab {
			return fmt.Errorf("eos_token_id %d is outside the vocabulary (vocab_size %d)", id, c.Vocab)
		}
	}
	if c.SlidingWindow < 0 {
		return fmt.Errorf("sliding_window must be >= 0, got %d", c.SlidingWindow)
	}
	return nil
}

func (r RopeConfig) validate() error {
	finite := func(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }
	if !(r.Theta > 0 && finite(r.Theta)) {
		return fmt.Errorf("rope_theta must be > 0, got %g", r.Theta)
	}
	switch r.Type {
	case "default":
		return nil
	case "llama3":
		if !(r.Factor > 0 && finite(r.Factor)) {
			return fmt.Errorf("llama3 rope factor must be > 0, got %g", r.Factor)
		}
		if !(r.LowFreqFactor > 0 && r.HighFreqFactor > r.LowFreqFactor && finite(r.HighFreqFactor)) {
			return fmt.Errorf("llama3 rope needs 0 < low_freq_factor < high_freq_factor, got %g and %g", r.LowFreqFactor, r.HighFreqFactor)
		}
		if r.OriginalMaxPos <= 0 {
			return fmt.Errorf("llama3 rope original_max_position_embeddings must be > 0, got %d", r.OriginalMaxPos)
		}
		return nil
	}
	return fmt.Errorf("unsupported rope_type %q (supported: default, llama3)", r.Type)
}

// TensorSpec names a tensor and its expected dtype-independent shape.
type TensorSpec struct {
	Name  string
	Shape []int
}

// Elements is the product of the shape.
func (s TensorSpec) Elements() int64 {
	n := int64(1)
	for _, d := range s.Shape {
		n *= int64(d)
	}
	return n
}

// LayerTensors lists the tensors of one decoder layer with their shapes in
// the HF layout ([out, in] for projections).
func (c *Config) LayerTensors(layer int) []TensorSpec {
	q, kv := c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	n := func(suffix string, shape ...int) TensorSpec {
		return TensorSpec{LayerTensorName(layer, suffix), shape}
	}
	specs := []TensorSpec{
		n(AttnNorm, c.Hidden),
		n(QProj, q, c.Hidden),
		n(KProj, kv, c.Hidden),
		n(VProj, kv, c.Hidden),
	}
	if c.AttentionBias {
		specs = append(specs, n(QBias, q), n(KBias, kv), n(VBias, kv))
	}
	return append(specs,
		n(OProj, c.Hidden, q),
		n(MLPNorm, c.Hidden),
		n(GateProj, c.Intermediate, c.Hidden),
		n(UpProj, c.Intermediate, c.Hidden),
		n(DownProj, c.Hidden, c.Intermediate),
	)
}

// Tensors lists what a stack holding layers first..last needs (last < first:
// no layers), plus the embeddings when embed, and the final norm and LM head
// (unless tied; then the embeddings) when head.
func (c *Config) Tensors(first, last int, embed, head bool) []TensorSpec {
	var specs []TensorSpec
	if embed || (head && c.TieEmbeddings) {
		specs = append(specs, TensorSpec{EmbedName, []int{c.Vocab, c.Hidden}})
	}
	for l := first; l <= last; l++ {
		specs = append(specs, c.LayerTensors(l)...)
	}
	if head {
		specs = append(specs, TensorSpec{FinalNormName, []int{c.Hidden}})
		if !c.TieEmbeddings {
			specs = append(specs, TensorSpec{LMHeadName, []int{c.Vocab, c.Hidden}})
		}
	}
	return specs
}

// LayerBytes is the weight bytes of one decoder layer stored as d.
func (c *Config) LayerBytes(d DType) int64 {
	var n int64
	for _, s := range c.LayerTensors(0) {
		n += s.Elements()
	}
	return n * int64(d.Size())
}

// EmbedBytes is the bytes of the token embedding table.
func (c *Config) EmbedBytes(d DType) int64 {
	return int64(c.Vocab) * int64(c.Hidden) * int64(d.Size())
}

// HeadBytes is the bytes of a separate LM head, 0 when tied to the
// embeddings. The final norm (Hidden elements) is not counted.
func (c *Config) HeadBytes(d DType) int64 {
	if c.TieEmbeddings {
		return 0
	}
	return c.EmbedBytes(d)
}

// TotalBytes is the bytes of every weight of the model stored as d.
func (c *Config) TotalBytes(d DType) int64 {
	return c.EmbedBytes(d) + c.HeadBytes(d) + int64(c.NumLayers)*c.LayerBytes(d) + int64(c.Hidden)*int64(d.Size())
}

// KVBytesPerToken is the KV-cache bytes one token takes in one layer.
func (c *Config) KVBytesPerToken(d DType) int64 {
	return 2 * int64(c.KVHeads) * int64(c.HeadDim) * int64(d.Size())
}
