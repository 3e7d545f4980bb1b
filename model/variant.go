package model

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"hash"
	"sort"
	"strconv"
	"strings"
)

// Variant names the weights a checkpoint holds, so a mesh never mixes
// nodes whose numbers differ (a Q4_K_M node and a Q8_0 node of one model
// are different variants). It is computed from tensor infos only, reading
// no tensor bytes.
type Variant struct {
	// Label is for people: the dominant dtype of the layers' matrices
	// ("bf16", "f32", "Q4_K") or a file's own name for its type ("Q4_K_M").
	Label string
	// Fingerprint is the hex SHA-256 over every tensor's name, dtype, shape
	// and stored size, and the config fields that change the numerics:
	// what two nodes must share to be replicas of each other.
	Fingerprint string
}

// MaxVariantLabel is the longest label VariantOf makes (wire.MaxVariantLabel).
const MaxVariantLabel = 32

// VariantOf computes the variant of ck under cfg. Every tensor of the
// checkpoint counts, not only those of some layer range, so nodes holding
// different ranges of one file agree; a sharded checkpoint must therefore
// have all its shards (or at least their headers) at hand. label, when not
// empty, replaces the computed label: a GGUF file names its type
// (Q4_K_M), which its mix of tensor dtypes does not spell.
func VariantOf(ck *Checkpoint, cfg *Config, label string) (Variant, error) {
	names := ck.Names()
	sort.Strings(names)
	h := sha256.New()
	h.Write([]byte("meshgpu-variant-v1\n"))
	writeConfig(h, cfg)
	elems := map[DType]int64{}    // elements of the layers' matrices per dtype
	fallback := map[DType]int64{} // of any matrix, when no layer has one
	for _, name := range names {
		t, err := ck.Info(name)
		if err != nil {
			return Variant{}, fmt.Errorf("variant: %w", err)
		}
		shape := make([]string, len(t.Shape))
		for i, d := range t.Shape {
			shape[i] = strconv.Itoa(d)
		}
		// Quoted strings keep the encoding unambiguous whatever a name holds.
		fmt.Fprintf(h, "tensor %q %q [%s] %d\n", t.Name, t.DType, strings.Join(shape, ","), t.Bytes)
		if len(t.Shape) == 2 {
			fallback[t.DType] += t.Elements()
			if strings.HasPrefix(name, "model.layers.") {
				elems[t.DType] += t.Elements()
			}
		}
	}
	if len(elems) == 0 {
		elems = fallback
	}
	if ck.gg != nil {
		ck.gg.writeFingerprint(h)
	}
	if label == "" && ck.gg != nil {
		label = ck.gg.fileType() // llama.cpp's name for the mix ("Q4_K_M")
	}
	if label == "" {
		label = dtypeLabel(dominant(elems))
	}
	return Variant{Label: cleanLabel(label), Fingerprint: hex.EncodeToString(h.Sum(nil))}, nil
}

// writeConfig hashes the config fields the forward pass computes with;
// token ids, context length and the like change no activation.
func writeConfig(h hash.Hash, c *Config) {
	f := func(v float64) string { return strconv.FormatFloat(v, 'g', -1, 64) }
	r := c.Rope
	fmt.Fprintf(h, "config %q %q hidden=%d intermediate=%d layers=%d heads=%d kv_heads=%d head_dim=%d vocab=%d rms_eps=%s tie=%t bias=%t\n",
		c.Architecture, c.ModelType, c.Hidden, c.Intermediate, c.NumLayers, c.Heads, c.KVHeads, c.HeadDim, c.Vocab, f(c.RMSEps),
		c.TieEmbeddings, c.AttentionBias)
	fmt.Fprintf(h, "rope %q theta=%s factor=%s low=%s high=%s original_max=%d\n",
		r.Type, f(r.Theta), f(r.Factor), f(r.LowFreqFactor), f(r.HighFreqFactor), r.OriginalMaxPos)
	if len(c.RopeFreqFactors) > 0 { // a GGUF's rope_freqs: values, not only the tensor's info
		fmt.Fprintf(h, "rope_freqs %v\n", c.RopeFreqFactors)
	}
}

// dominant is the dtype with the most elements (ties: the first by name,
// so the label does not depend on map order).
func dominant(elems map[DType]int64) DType {
	var best DType
	for d, n := range elems {
		if best == "" || n > elems[best] || (n == elems[best] && d < best) {
			best = d
		}
	}
	return best
}

// dtypeLabel spells float dtypes as people do ("bf16") and quantized ones
// as ggml does ("Q4_K").
func dtypeLabel(d DType) string {
	switch d {
	case BF16, F16, F32:
		return strings.ToLower(string(d))
	case "":
		return "empty"
	}
	return string(d)
}

// cleanLabel keeps a label to what the wire allows: [A-Za-z0-9._+-], at
// most MaxVariantLabel bytes.
func cleanLabel(s string) string {
	b := []byte(s)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '+' || c == '-') {
			b[i] = '_'
		}
	}
	if len(b) > MaxVariantLabel {
		b = b[:MaxVariantLabel]
	}
	return string(b)
}

// LayerBytesStored is the bytes decoder layer layer's tensors take in the
// checkpoint as stored (a Q4_K layer is about a quarter of a bf16 one, and
// a mixed file's layers differ), from tensor infos.
func LayerBytesStored(ck *Checkpoint, cfg *Config, layer int) (int64, error) {
	return storedBytes(ck, cfg.LayerTensors(layer))
}

// EmbedBytesStored is the stored bytes of the token embeddings.
func EmbedBytesStored(ck *Checkpoint, cfg *Config) (int64, error) {
	return storedBytes(ck, []TensorSpec{{Name: EmbedName}})
}

// HeadBytesStored is the stored bytes a stack holding the last layer adds:
// the final norm and the LM head, which is the embeddings when tied.
func HeadBytesStored(ck *Checkpoint, cfg *Config) (int64, error) {
	head := LMHeadName
	if cfg.TieEmbeddings {
		head = EmbedName
	}
	return storedBytes(ck, []TensorSpec{{Name: FinalNormName}, {Name: head}})
}

func storedBytes(ck *Checkpoint, specs []TensorSpec) (int64, error) {
	var n int64
	for _, s := range specs {
		t, err := ck.Info(s.Name)
		if err != nil {
			return 0, err
		}
		n += t.Bytes
	}
	return n, nil
}
