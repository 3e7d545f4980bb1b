package model

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"meshgpu/model/gguf"

	"golang.org/x/sys/unix"
)

// A GGUF model is read through the same Checkpoint and Config as a Hugging
// Face directory: its tensors appear under the Hugging Face names (so one
// loader serves both formats), its hyperparameters become a Config, and the
// q/k row order llama.cpp's converter writes is undone on the way out, so
// the same weights give the same numbers from either file.

// IsGGUF reports whether path names a GGUF file (by its .gguf extension;
// a directory never is one).
func IsGGUF(path string) bool {
	if !strings.EqualFold(filepath.Ext(path), ".gguf") {
		return false
	}
	st, err := os.Stat(path)
	return err == nil && !st.IsDir()
}

// ggufArchitectures maps general.architecture to the Hugging Face class
// whose tensors and numerics it has.
var ggufArchitectures = map[string]string{
	"llama": "LlamaForCausalLM",
	"qwen2": "Qwen2ForCausalLM",
}

// ggufWholeNames and ggufLayerNames map GGUF tensor names to Hugging Face
// ones; a GGUF layer tensor is "blk.<layer>.<suffix>".
var (
	ggufWholeNames = map[string]string{
		"token_embd.weight":  EmbedName,
		"output_norm.weight": FinalNormName,
		"output.weight":      LMHeadName,
	}
	ggufLayerNames = map[string]string{
		"attn_norm.weight":   AttnNorm,
		"attn_q.weight":      QProj,
		"attn_k.weight":      KProj,
		"attn_v.weight":      VProj,
		"attn_q.bias":        QBias,
		"attn_k.bias":        KBias,
		"attn_v.bias":        VBias,
		"attn_output.weight": OProj,
		"ffn_norm.weight":    MLPNorm,
		"ffn_gate.weight":    GateProj,
		"ffn_up.weight":      UpProj,
		"ffn_down.weight":    DownProj,
	}
)

// ggufRopeFreqs is the tensor of rotary frequency divisors (llama3 scaling).
const ggufRopeFreqs = "rope_freqs.weight"

// hfName is the Hugging Face name of a GGUF tensor, or the GGUF name itself
// for a tensor with no counterpart (rope_freqs).
func hfName(name string) string {
	if hf, ok := ggufWholeNames[name]; ok {
		return hf
	}
	if rest, ok := strings.CutPrefix(name, "blk."); ok {
		if num, suffix, ok := strings.Cut(rest, "."); ok {
			if l, err := strconv.Atoi(num); err == nil && l >= 0 && strconv.Itoa(l) == num {
				if hf, ok := ggufLayerNames[suffix]; ok {
					return LayerTensorName(l, hf)
				}
			}
		}
	}
	return name
}

// ggufDType names a ggml type as a DType: the float types as safetensors
// spells them, the rest by ggml's name ("Q4_K").
func ggufDType(t gguf.Type) DType {
	switch t {
	case gguf.F32:
		return F32
	case gguf.F16:
		return F16
	case gguf.BF16:
		return BF16
	}
	return DType(t.String())
}

// ggufModel is an opened GGUF model: one file or all parts of a split one.
type ggufModel struct {
	path  string
	parts []*gguf.Mapped
	// partial holds each part's sidecar when the hub fetched it only in
	// part (nil entries for complete parts).
	partial []*GGUFSidecar
	meta    *gguf.File // the first part's header, which holds the metadata
	where   map[string]ggufTensor
	// permute maps the HF names of the q/k tensors whose rows llama.cpp's
	// converter reordered to the number of heads they hold.
	permute map[string]int
}

type ggufTensor struct {
	part int
	info gguf.TensorInfo
}

// GGUFSplitName matches the parts of a split GGUF as llama.cpp's gguf-split
// names them, NAME-00001-of-00003.gguf: the name, the part, the count, the
// extension as spelled.
var GGUFSplitName = regexp.MustCompile(`(?i)^(.*)-(\d{5})-of-(\d{5})(\.gguf)$`)

// quantToken matches the quantization names llama.cpp puts in file names.
var quantToken = regexp.MustCompile(`(?i)^(I?Q\d+(_[A-Z0-9]+)*|TQ\d_\d|B?F16|F32|F64|MXFP4(_MOE)?)$`)

// IsQuantTag reports whether one '-'/'.'-separated word of a file name is a
// quantization name ("Q4_K_M", "bf16", "IQ4_XS").
func IsQuantTag(word string) bool { return quantToken.MatchString(word) }

// openGGUF opens path, and the other parts when path is one part of a
// split model.
func openGGUF(path string) (*ggufModel, error) {
	paths := []string{path}
	if m := GGUFSplitName.FindStringSubmatch(filepath.Base(path)); m != nil {
		n, _ := strconv.Atoi(m[3])
		if n < 1 || n > 9999 {
			return nil, fmt.Errorf("%s: a split of %d parts is not valid", path, n)
		}
		paths = paths[:0]
		for i := 1; i <= n; i++ {
			paths = append(paths, filepath.Join(filepath.Dir(path), fmt.Sprintf("%s-%05d-of-%s%s", m[1], i, m[3], m[4])))
		}
	}
	g := &ggufModel{path: path, where: map[string]ggufTensor{}}
	for i, p := range paths {
		mp, err := gguf.Open(p)
		if err != nil {
			g.close()
			if errors.Is(err, os.ErrNotExist) && len(paths) > 1 {
				return nil, fmt.Errorf("%s: part %d of %d is missing: %w", path, i+1, len(paths), err)
			}
			return nil, err
		}
		g.parts = append(g.parts, mp)
		sc, err := readGGUFSidecar(p, mp.Size)
		if err != nil {
			g.close()
			return nil, err
		}
		g.partial = append(g.partial, sc)
		if err := checkSplitPart(mp, i, len(paths)); err != nil {
			g.close()
			return nil, err
		}
		for _, t := range mp.Tensors {
			name := hfName(t.Name)
			if prev, dup := g.where[name]; dup {
				g.close()
				return nil, fmt.Errorf("%s: tensors %q (part %d) and %q (part %d) are both %s", p, prev.info.Name, prev.part+1, t.Name, i+1, name)
			}
			g.where[name] = ggufTensor{part: i, info: t}
		}
	}
	g.meta = g.parts[0].File
	if arch, _ := g.str("general.architecture"); arch == "llama" {
		heads, _ := g.uint("llama.attention.head_count")
		kvHeads, ok := g.uint("llama.attention.head_count_kv")
		if !ok {
			kvHeads = heads
		}
		g.permute = map[string]int{}
		for name := range g.where {
			switch {
			case strings.HasSuffix(name, "."+QProj), strings.HasSuffix(name, "."+QBias):
				g.permute[name] = int(heads)
			case strings.HasSuffix(name, "."+KProj), strings.HasSuffix(name, "."+KBias):
				g.permute[name] = int(kvHeads)
			}
		}
	}
	return g, nil
}

// checkSplitPart checks that part i of n says it is (split.no, split.count);
// a single file needs no split keys.
func checkSplitPart(mp *gguf.Mapped, i, n int) error {
	v, ok := mp.Get("split.count")
	if !ok {
		if n == 1 {
			return nil
		}
		return fmt.Errorf("%s: named as part %d of %d but has no split.count", mp.Path, i+1, n)
	}
	count, _ := v.Uint()
	no, _ := mp.Get("split.no")
	idx, ok := no.Uint()
	if count != uint64(n) || !ok || idx != uint64(i) {
		return fmt.Errorf("%s: says it is part %s of %s, but its name makes it part %d of %d", mp.Path, no, v, i+1, n)
	}
	return nil
}

func (g *ggufModel) close() error {
	var errs []error
	for _, p := range g.parts {
		errs = append(errs, p.Close())
	}
	g.parts = nil
	return errors.Join(errs...)
}

func (g *ggufModel) str(key string) (string, bool) {
	v, ok := g.meta.Get(key)
	if !ok {
		return "", false
	}
	return v.Str()
}

func (g *ggufModel) uint(key string) (uint64, bool) {
	v, ok := g.meta.Get(key)
	if !ok {
		return 0, false
	}
	return v.Uint()
}

func (g *ggufModel) float(key string) (float64, bool) {
	v, ok := g.meta.Get(key)
	if !ok {
		return 0, false
	}
	return v.Float()
}

func (g *ggufModel) names() []string {
	names := make([]string, 0, len(g.where))
	for n := range g.where {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// tensor returns a tensor under its Hugging Face name. Its Data aliases the
// mapping, except for q/k tensors whose rows are put back in Hugging Face
// order, which are copies.
func (g *ggufModel) tensor(name string, data bool) (Tensor, []byte, error) {
	e, ok := g.where[name]
	if !ok {
		return Tensor{}, nil, fmt.Errorf("%s: tensor %q is missing from the file", g.path, name)
	}
	if g.parts == nil {
		return Tensor{}, nil, fmt.Errorf("%s: file is closed", g.path)
	}
	t := Tensor{Name: name, DType: ggufDType(e.info.Type), Shape: e.info.Shape(), Bytes: int64(e.info.Size)}
	if !data {
		return t, nil, nil
	}
	if err := g.onDisk(e); err != nil {
		return Tensor{}, nil, err
	}
	var pages []byte
	t.Data, pages = g.parts[e.part].Data(e.info)
	if heads, ok := g.permute[name]; ok {
		out, err := unpermuteRows(t.Data, e.info, heads)
		if err != nil {
			return Tensor{}, nil, fmt.Errorf("%s: tensor %q: %w", g.path, e.info.Name, err)
		}
		t.Data = out
	}
	return t, pages, nil
}

// onDisk refuses a tensor whose bytes a partial hub download never fetched.
func (g *ggufModel) onDisk(e ggufTensor) error {
	sc := g.partial[e.part]
	if sc == nil {
		return nil
	}
	start := g.parts[e.part].DataOffset + int64(e.info.Offset)
	if !sc.Covers(start, start+int64(e.info.Size)) {
		return fmt.Errorf("%s: tensor %q was not downloaded: the hub fetched this file for other layers; give --model the hub reference (org/name:TAG) with these --layers to fetch it", g.parts[e.part].Path, e.info.Name)
	}
	return nil
}

// pages is the mapped pages a tensor lies in; nil when it is unknown or
// the file is closed.
func (g *ggufModel) pages(name string) []byte {
	e, ok := g.where[name]
	if !ok || g.parts == nil {
		return nil
	}
	_, pages := g.parts[e.part].Data(e.info)
	return pages
}

// unpermuteRows undoes llama.cpp's converter, which reorders each head's
// rows from Hugging Face's rotate-half layout (the first half of a head's
// dimensions, then the second) to interleaved pairs for its RoPE: GGUF row
// h*hd + 2j + i holds HF row h*hd + i*hd/2 + j. Rows are whole runs of
// blocks, so this works on every type; a 1-D bias permutes elements.
func unpermuteRows(src []byte, info gguf.TensorInfo, heads int) ([]byte, error) {
	rows := int(info.Elements() / info.Dims[0])
	rowBytes := int(info.Size) / rows
	if len(info.Dims) == 1 { // a bias: its elements are the rows
		if elems, _ := info.Type.Block(); elems != 1 {
			return nil, fmt.Errorf("a 1-D %s tensor cannot be reordered by rows", info.Type)
		}
		rows = int(info.Dims[0])
		rowBytes = int(info.Size) / rows
	}
	if heads <= 0 || rows%heads != 0 || (rows/heads)%2 != 0 {
		return nil, fmt.Errorf("%d rows do not split into %d heads of an even size", rows, heads)
	}
	return reorderHeadRows(src, rowBytes, heads, false), nil
}

// reorderHeadRows moves rows between Hugging Face's order (within a head,
// the first half of its dimensions, then the second) and llama.cpp's
// (pairs interleaved): HF row h*hd + i*hd/2 + j is GGUF row h*hd + 2j + i.
// toGGUF says which way.
func reorderHeadRows(src []byte, rowBytes, heads int, toGGUF bool) []byte {
	hd := len(src) / rowBytes / heads
	out := make([]byte, len(src))
	for h := 0; h < heads; h++ {
		for i := 0; i < 2; i++ {
			for j := 0; j < hd/2; j++ {
				hf, gg := h*hd+i*hd/2+j, h*hd+2*j+i
				dst, from := hf, gg
				if toGGUF {
					dst, from = gg, hf
				}
				copy(out[dst*rowBytes:(dst+1)*rowBytes], src[from*rowBytes:(from+1)*rowBytes])
			}
		}
	}
	return out
}

// config reads the hyperparameters from the metadata.
func (g *ggufModel) config() (*Config, error) {
	arch, _ := g.str("general.architecture")
	hfArch, ok := ggufArchitectures[arch]
	if !ok {
		return nil, fmt.Errorf("general.architecture %q is not supported (supported: llama, qwen2)", arch)
	}
	c := &Config{Architecture: hfArch, ModelType: arch, BOS: -1, EOS: []int{}}
	need := func(key string) int {
		v, ok := g.uint(arch + "." + key)
		if !ok || v > math.MaxInt32 {
			return -1
		}
		return int(v)
	}
	for _, f := range []struct {
		key string
		dst *int
	}{
		{"block_count", &c.NumLayers}, {"embedding_length", &c.Hidden}, {"feed_forward_length", &c.Intermediate},
		{"attention.head_count", &c.Heads}, {"context_length", &c.MaxPositions},
	} {
		if *f.dst = need(f.key); *f.dst < 0 {
			return nil, fmt.Errorf("metadata %s.%s is missing or not a non-negative integer", arch, f.key)
		}
	}
	c.KVHeads = c.Heads
	if v := need("attention.head_count_kv"); v >= 0 {
		c.KVHeads = v
	}
	if c.Heads > 0 {
		c.HeadDim = c.Hidden / c.Heads
	}
	if v := need("attention.key_length"); v >= 0 {
		c.HeadDim = v
	}
	if v := need("attention.value_length"); v >= 0 && v != c.HeadDim {
		return nil, fmt.Errorf("value head size %d differs from the key head size %d, which is not supported", v, c.HeadDim)
	}
	if v := need("rope.dimension_count"); v >= 0 && v != c.HeadDim {
		return nil, fmt.Errorf("RoPE over %d of a head's %d dimensions is not supported", v, c.HeadDim)
	}
	eps, ok := g.float(arch + ".attention.layer_norm_rms_epsilon")
	if !ok {
		return nil, fmt.Errorf("metadata %s.attention.layer_norm_rms_epsilon is missing", arch)
	}
	c.RMSEps = eps
	c.Rope = RopeConfig{Type: "default", Theta: 10000}
	if v, ok := g.float(arch + ".rope.freq_base"); ok {
		c.Rope.Theta = v
	}
	if st, ok := g.str(arch + ".rope.scaling.type"); ok && st != "none" {
		if f, _ := g.float(arch + ".rope.scaling.factor"); st != "linear" || f != 1 {
			return nil, fmt.Errorf("rope scaling %q is not supported (llama3 scaling comes as a rope_freqs tensor)", st)
		}
	}
	if _, ok := g.where[ggufRopeFreqs]; ok {
		ff, err := g.ropeFreqs(c.HeadDim)
		if err != nil {
			return nil, err
		}
		c.RopeFreqFactors = ff
	}
	c.Vocab = need("vocab_size")
	if c.Vocab < 0 {
		if v, ok := g.meta.Get("tokenizer.ggml.tokens"); ok {
			c.Vocab = v.Len()
		} else if e, ok := g.where[EmbedName]; ok && len(e.info.Dims) == 2 {
			c.Vocab = int(e.info.Dims[1])
		}
	}
	_, hasHead := g.where[LMHeadName]
	c.TieEmbeddings = !hasHead
	_, c.AttentionBias = g.where[LayerTensorName(0, QBias)]
	if arch == "llama" && c.AttentionBias {
		// As for config.json: llama with biases also biases o_proj.
		return nil, errors.New("llama with attention biases is not supported")
	}
	if v, ok := g.uint("tokenizer.ggml.bos_token_id"); ok && v < math.MaxInt32 {
		c.BOS = int(v)
	}
	for _, key := range []string{"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"} {
		if v, ok := g.uint(key); ok && v < math.MaxInt32 && !containsInt(c.EOS, int(v)) {
			c.EOS = append(c.EOS, int(v))
		}
	}
	c.TorchDType = g.fileType()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return c, nil
}

func containsInt(s []int, v int) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// ropeFreqs reads the rope_freqs tensor: head_dim/2 f32 divisors.
func (g *ggufModel) ropeFreqs(headDim int) ([]float32, error) {
	t, _, err := g.tensor(ggufRopeFreqs, true)
	if err != nil {
		return nil, err
	}
	if t.DType != F32 || len(t.Shape) != 1 || t.Shape[0] != headDim/2 {
		return nil, fmt.Errorf("%s: %s is %s %v; want F32 [%d]", g.path, ggufRopeFreqs, t.DType, t.Shape, headDim/2)
	}
	ff := make([]float32, headDim/2)
	for i := range ff {
		ff[i] = math.Float32frombits(binary.LittleEndian.Uint32(t.Data[4*i:]))
		if !(ff[i] > 0) || math.IsInf(float64(ff[i]), 0) {
			return nil, fmt.Errorf("%s: %s[%d] is %g; each must be positive", g.path, ggufRopeFreqs, i, ff[i])
		}
	}
	return ff, nil
}

// fingerprintKeys are the metadata that tell apart two files of the same
// tensor types and shapes: how they were quantized (llama.cpp's version of
// the formats, an importance matrix) and how text becomes tokens.
var fingerprintKeys = []string{
	"general.quantization_version", "quantize.imatrix.file", "quantize.imatrix.dataset",
	"quantize.imatrix.entries_count", "quantize.imatrix.chunks_count",
	"tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template",
}

// writeFingerprint adds those keys to a variant's fingerprint. It cannot
// tell two quantizations apart that differ only in their blocks' bytes
// (the fingerprint reads no tensor data, which a partial download lacks).
func (g *ggufModel) writeFingerprint(w io.Writer) {
	for _, k := range fingerprintKeys {
		if v, ok := g.meta.Get(k); ok {
			fmt.Fprintf(w, "gguf %q %q\n", k, v.String())
		}
	}
}

// ggufFileTypes are llama.cpp's names of general.file_type values.
var ggufFileTypes = map[uint64]string{
	0: "F32", 1: "F16", 7: "Q8_0", 10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L",
	14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16",
	2: "Q4_0", 3: "Q4_1", 8: "Q5_0", 9: "Q5_1",
}

// fileType is the file's type label ("Q4_K_M"), from general.file_type or,
// failing that, the type of its embedding.
func (g *ggufModel) fileType() string {
	if v, ok := g.uint("general.file_type"); ok {
		if s, ok := ggufFileTypes[v]; ok {
			return s
		}
	}
	if e, ok := g.where[EmbedName]; ok {
		return e.info.Type.String()
	}
	return ""
}

// madvise asks the kernel to read a tensor's pages ahead; advice only.
func madviseWillNeed(pages []byte) {
	if len(pages) > 0 {
		_ = unix.Madvise(pages, unix.MADV_WILLNEED)
	}
}

// DefaultName is the model name a node announces when none is given: the
// directory's base name, or a GGUF file's base name without its extension,
// split suffix and quantization tag, so every variant of a model
// ("gocoder-6m-q4_k_m.gguf", "gocoder-6m-bf16.gguf") shares one name.
func DefaultName(path string) string {
	base := filepath.Base(filepath.Clean(path))
	if !IsGGUF(path) {
		return base
	}
	if m := GGUFSplitName.FindStringSubmatch(base); m != nil {
		base = m[1]
	} else {
		base = strings.TrimSuffix(base, filepath.Ext(base))
	}
	// Drop the last word when it is a quantization name, and the separator.
	if i := strings.LastIndexAny(base, "-."); i > 0 && IsQuantTag(base[i+1:]) {
		return base[:i]
	}
	return base
}
