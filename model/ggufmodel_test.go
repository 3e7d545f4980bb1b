package model

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/model/gguf"
)

// The bf16 GGUF holds the same weights as the safetensors directory, written
// by llama.cpp's converter (q/k rows permuted, 1-D tensors in f32). Read
// through Checkpoint, every matrix must come back byte-equal under its
// Hugging Face name: that checks the name map and the unpermutation against
// an independent writer.
func TestGGUFTensorsEqualSafetensors(t *testing.T) {
	st, err := Open(testenv.GoCoder(t))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	gg, err := Open(testenv.GoCoderGGUF(t, "bf16"))
	if err != nil {
		t.Fatal(err)
	}
	defer gg.Close()
	compared := 0
	for _, name := range st.Names() {
		a, err := st.Tensor(name)
		if err != nil {
			t.Fatal(err)
		}
		b, err := gg.Tensor(name)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if !reflect.DeepEqual(a.Shape, b.Shape) {
			t.Fatalf("%s: shape %v from GGUF, %v from safetensors", name, b.Shape, a.Shape)
		}
		switch {
		case b.DType == BF16:
			if !bytes.Equal(a.Data, b.Data) {
				t.Errorf("%s: bf16 bytes differ", name)
			}
		case b.DType == F32 && a.DType == BF16: // norms: bf16 upcast exactly
			for i := 0; i < int(a.Elements()); i++ {
				if a.Data[2*i] != b.Data[4*i+2] || a.Data[2*i+1] != b.Data[4*i+3] || b.Data[4*i] != 0 || b.Data[4*i+1] != 0 {
					t.Fatalf("%s: element %d differs", name, i)
				}
			}
		default:
			t.Fatalf("%s: %s in GGUF, %s in safetensors", name, b.DType, a.DType)
		}
		compared++
	}
	if compared != len(st.Names()) || compared < 50 {
		t.Fatalf("compared %d tensors", compared)
	}
}

// Without the unpermutation the q/k tensors would differ: the check above
// can fail.
func TestGGUFPermutationIsVisible(t *testing.T) {
	gg, err := Open(testenv.GoCoderGGUF(t, "bf16"))
	if err != nil {
		t.Fatal(err)
	}
	defer gg.Close()
	name := LayerTensorName(0, QProj)
	e := gg.gg.where[name]
	raw, _ := gg.gg.parts[e.part].Data(e.info)
	got, err := gg.Tensor(name)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(raw, got.Data) {
		t.Fatal("q_proj came back in the file's row order")
	}
}

func TestGGUFConfigEqualsConfigJSON(t *testing.T) {
	want, err := LoadConfig(testenv.GoCoder(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range []string{"bf16", "q8_0", "q4_k_m"} {
		got, err := LoadConfig(testenv.GoCoderGGUF(t, v))
		if err != nil {
			t.Fatal(err)
		}
		if len(got.RopeFreqFactors) != got.HeadDim/2 {
			t.Fatalf("%s: %d rope frequency factors", v, len(got.RopeFreqFactors))
		}
		// The GGUF carries llama3 scaling as factors; the rest must agree.
		g, w := *got, *want
		g.Rope, w.Rope = RopeConfig{}, RopeConfig{}
		g.RopeFreqFactors, g.TorchDType, w.TorchDType = nil, "", ""
		if g.RMSEps != w.RMSEps && float32(g.RMSEps) == float32(w.RMSEps) {
			g.RMSEps = w.RMSEps // stored as f32 in GGUF
		}
		if !reflect.DeepEqual(g, w) {
			t.Errorf("%s:\n got %+v\nwant %+v", v, g, w)
		}
		if got.Rope.Theta != want.Rope.Theta {
			t.Errorf("%s: rope theta %g, want %g", v, got.Rope.Theta, want.Rope.Theta)
		}
	}
}

// The factors equal HF's llama3 scaling of the same config: the ratio of
// unscaled to scaled inverse frequency.
func TestGGUFRopeFactorsMatchLlama3(t *testing.T) {
	want, err := LoadConfig(testenv.GoCoder(t))
	if err != nil {
		t.Fatal(err)
	}
	got, err := LoadConfig(testenv.GoCoderGGUF(t, "bf16"))
	if err != nil {
		t.Fatal(err)
	}
	r := want.Rope
	for i, f := range got.RopeFreqFactors {
		inv := 1 / pow(r.Theta, float64(2*i)/float64(want.HeadDim))
		wavelen := 2 * 3.141592653589793 / inv
		lowWL, highWL := float64(r.OriginalMaxPos)/r.LowFreqFactor, float64(r.OriginalMaxPos)/r.HighFreqFactor
		scaled := inv
		switch {
		case wavelen > lowWL:
			scaled = inv / r.Factor
		case wavelen >= highWL:
			s := (float64(r.OriginalMaxPos)/wavelen - r.LowFreqFactor) / (r.HighFreqFactor - r.LowFreqFactor)
			scaled = (1-s)*inv/r.Factor + s*inv
		}
		if d := float64(f) - inv/scaled; d > 1e-5 || d < -1e-5 {
			t.Errorf("factor %d: %g, llama3 gives %g", i, f, inv/scaled)
		}
	}
}

// relabelGGUF copies src to dst with the named tensors' types changed; a
// tensor whose size changes with its type gets zero bytes.
func relabelGGUF(t *testing.T, src, dst string, types map[string]gguf.Type) {
	t.Helper()
	in, err := gguf.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	ts := make([]gguf.WriteTensor, len(in.Tensors))
	for i, ti := range in.Tensors {
		ts[i] = gguf.WriteTensor{Name: ti.Name, Dims: ti.Dims, Type: ti.Type}
		if ty, ok := types[ti.Name]; ok {
			ts[i].Type = ty
		}
	}
	f, err := os.Create(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := gguf.Write(f, in.KV, ts, func(i int, w io.Writer) error {
		data, _ := in.Data(in.Tensors[i])
		if ts[i].Type != in.Tensors[i].Type {
			row, _ := ts[i].Type.RowBytes(ts[i].Dims[0])
			n := row
			for _, d := range ts[i].Dims[1:] {
				n *= d
			}
			data = make([]byte, n)
		}
		_, err := w.Write(data)
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

// The quantized types with CPU kernels pass Check; another quantized type,
// or a quantized norm, is refused naming the tensor and its type.
func TestGGUFQuantizedCheck(t *testing.T) {
	path := testenv.GoCoderGGUF(t, "q4_k_m")
	check := func(path string) error {
		ck, err := Open(path)
		if err != nil {
			t.Fatal(err)
		}
		defer ck.Close()
		cfg, err := LoadConfig(path)
		if err != nil {
			t.Fatal(err)
		}
		return ck.Check(cfg, 0, cfg.NumLayers-1, true, true)
	}
	if err := check(path); err != nil {
		t.Fatalf("Q4_K_M: %v", err)
	}
	dir := t.TempDir()
	for _, c := range []struct {
		tensor string
		ty     gguf.Type
		hf     string
	}{
		{"blk.1.ffn_gate.weight", gguf.Q4_0, LayerTensorName(1, GateProj)},
		{"blk.0.attn_norm.weight", gguf.Q8_0, LayerTensorName(0, AttnNorm)},
	} {
		p := filepath.Join(dir, c.ty.String()+".gguf")
		relabelGGUF(t, path, p, map[string]gguf.Type{c.tensor: c.ty})
		err := check(p)
		if err == nil || !strings.Contains(err.Error(), c.ty.String()) || !strings.Contains(err.Error(), c.hf) {
			t.Errorf("%s as %s: want a refusal naming the tensor and its type, got %v", c.tensor, c.ty, err)
		}
	}
}

// writeTinyGGUF writes a GGUF holding the given tensors (f32 zeros) and
// metadata, for split and error tests.
func writeTinyGGUF(t *testing.T, path string, kv []gguf.KV, names []string) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ts := make([]gguf.WriteTensor, len(names))
	for i, n := range names {
		ts[i] = gguf.WriteTensor{Name: n, Dims: []uint64{8}, Type: gguf.F32}
	}
	if _, err := gguf.Write(f, kv, ts, func(i int, w io.Writer) error {
		_, err := w.Write(make([]byte, 32))
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

func pow(b, e float64) float64 { return math.Pow(b, e) }

// A split model (llama.cpp's gguf-split names) opens as one from any part;
// a missing part or parts that disagree about the split are refused.
func TestGGUFSplitOpensAsOne(t *testing.T) {
	dir := t.TempDir()
	part := func(i int, names ...string) {
		kv := []gguf.KV{{Key: "split.no", Value: gguf.Uint16(uint16(i))}, {Key: "split.count", Value: gguf.Uint16(3)}}
		if i == 0 {
			kv = append([]gguf.KV{{Key: "general.architecture", Value: gguf.String("llama")}}, kv...)
		}
		writeTinyGGUF(t, filepath.Join(dir, "m-0000"+string(rune('1'+i))+"-of-00003.gguf"), kv, names)
	}
	part(0, "token_embd.weight", "blk.0.attn_norm.weight")
	part(1, "blk.1.attn_norm.weight")
	part(2, "output_norm.weight")
	for _, p := range []string{"m-00001-of-00003.gguf", "m-00003-of-00003.gguf"} {
		ck, err := Open(filepath.Join(dir, p))
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range []string{EmbedName, LayerTensorName(0, AttnNorm), LayerTensorName(1, AttnNorm), FinalNormName} {
			if _, err := ck.Tensor(n); err != nil {
				t.Errorf("%s: %v", p, err)
			}
		}
		if ck.GGUF() == nil || ck.GGUF().KV[0].Key != "general.architecture" {
			t.Errorf("%s: metadata is not the first part's", p)
		}
		ck.Close()
	}
	os.Remove(filepath.Join(dir, "m-00002-of-00003.gguf"))
	if _, err := Open(filepath.Join(dir, "m-00001-of-00003.gguf")); err == nil || !strings.Contains(err.Error(), "part 2 of 3 is missing") {
		t.Fatalf("missing part: %v", err)
	}
	part(1, "blk.1.attn_norm.weight", "output_norm.weight")
	if _, err := Open(filepath.Join(dir, "m-00001-of-00003.gguf")); err == nil || !strings.Contains(err.Error(), "are both") {
		t.Fatalf("tensor in two parts: %v", err)
	}
	writeTinyGGUF(t, filepath.Join(dir, "m-00002-of-00003.gguf"), []gguf.KV{{Key: "split.no", Value: gguf.Uint16(2)}, {Key: "split.count", Value: gguf.Uint16(3)}}, []string{"blk.1.attn_norm.weight"})
	if _, err := Open(filepath.Join(dir, "m-00001-of-00003.gguf")); err == nil || !strings.Contains(err.Error(), "says it is part") {
		t.Fatalf("misnumbered part: %v", err)
	}
}

func TestDefaultName(t *testing.T) {
	dir := t.TempDir()
	for file, want := range map[string]string{
		"gocoder-6m-q4_k_m.gguf":              "gocoder-6m",
		"Llama-3.1-8B-Instruct-Q4_K_M.gguf":   "Llama-3.1-8B-Instruct",
		"model.Q8_0.gguf":                     "model",
		"qwen2.5-7b-bf16-00001-of-00003.gguf": "qwen2.5-7b",
		"plain.gguf":                          "plain",
		"Q4_K_M.gguf":                         "Q4_K_M",
	} {
		p := filepath.Join(dir, file)
		os.WriteFile(p, nil, 0o644)
		if got := DefaultName(p); got != want {
			t.Errorf("%s: %q, want %q", file, got, want)
		}
	}
	if got := DefaultName(filepath.Join(dir) + "/"); got != filepath.Base(dir) {
		t.Errorf("directory: %q", got)
	}
}

// SynthGGUF writes the weights Synth writes: through Checkpoint the two
// formats agree tensor by tensor, and so do their configs.
func TestSynthGGUFEqualsSynth(t *testing.T) {
	dir := t.TempDir()
	opts := SynthOptions{Shape: "tiny", Seed: 7}
	if _, err := Synth(context.Background(), filepath.Join(dir, "hf"), opts); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "tiny.gguf")
	if _, err := SynthGGUF(context.Background(), path, opts); err != nil {
		t.Fatal(err)
	}
	a, err := Open(filepath.Join(dir, "hf"))
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if len(a.Names()) != len(b.Names()) {
		t.Fatalf("%d tensors in the directory, %d in the GGUF", len(a.Names()), len(b.Names()))
	}
	for _, name := range a.Names() {
		x, _ := a.Tensor(name)
		y, err := b.Tensor(name)
		if err != nil {
			t.Fatal(err)
		}
		if y.DType == F32 {
			for i := 0; i < int(x.Elements()); i++ {
				if x.Data[2*i] != y.Data[4*i+2] || x.Data[2*i+1] != y.Data[4*i+3] {
					t.Fatalf("%s: element %d differs", name, i)
				}
			}
		} else if !bytes.Equal(x.Data, y.Data) {
			t.Fatalf("%s differs", name)
		}
	}
	ca, _ := LoadConfig(filepath.Join(dir, "hf"))
	cb, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	ca.TorchDType, cb.TorchDType = "", ""
	if float32(ca.RMSEps) == float32(cb.RMSEps) {
		cb.RMSEps = ca.RMSEps
	}
	if !reflect.DeepEqual(ca, cb) {
		t.Fatalf("configs differ:\n%+v\n%+v", ca, cb)
	}
}

// A qwen2 GGUF: its hyperparameters under qwen2.*, q/k/v biases, and no
// row permutation (llama.cpp's converter permutes only llama's q/k).
func TestGGUFQwen2(t *testing.T) {
	const hidden, heads, kv, hd, inter, vocab = 64, 4, 2, 16, 128, 300
	q := func(k string) string { return "qwen2." + k }
	kvs := []gguf.KV{
		{Key: "general.architecture", Value: gguf.String("qwen2")},
		{Key: q("block_count"), Value: gguf.Uint32(1)}, {Key: q("context_length"), Value: gguf.Uint32(32768)},
		{Key: q("embedding_length"), Value: gguf.Uint32(hidden)}, {Key: q("feed_forward_length"), Value: gguf.Uint32(inter)},
		{Key: q("attention.head_count"), Value: gguf.Uint32(heads)}, {Key: q("attention.head_count_kv"), Value: gguf.Uint32(kv)},
		{Key: q("rope.freq_base"), Value: gguf.Float32(1e6)}, {Key: q("attention.layer_norm_rms_epsilon"), Value: gguf.Float32(1e-6)},
		{Key: "tokenizer.ggml.bos_token_id", Value: gguf.Uint32(5)}, {Key: "tokenizer.ggml.eos_token_id", Value: gguf.Uint32(7)},
		{Key: "tokenizer.ggml.eot_token_id", Value: gguf.Uint32(8)},
	}
	type spec struct {
		name string
		dims []uint64
	}
	specs := []spec{{"token_embd.weight", []uint64{hidden, vocab}}, {"output_norm.weight", []uint64{hidden}}, {"output.weight", []uint64{hidden, vocab}}}
	for _, s := range []spec{{"attn_norm.weight", []uint64{hidden}}, {"attn_q.weight", []uint64{hidden, heads * hd}}, {"attn_q.bias", []uint64{heads * hd}},
		{"attn_k.weight", []uint64{hidden, kv * hd}}, {"attn_k.bias", []uint64{kv * hd}}, {"attn_v.weight", []uint64{hidden, kv * hd}}, {"attn_v.bias", []uint64{kv * hd}},
		{"attn_output.weight", []uint64{heads * hd, hidden}}, {"ffn_norm.weight", []uint64{hidden}}, {"ffn_gate.weight", []uint64{hidden, inter}},
		{"ffn_up.weight", []uint64{hidden, inter}}, {"ffn_down.weight", []uint64{inter, hidden}}} {
		specs = append(specs, spec{"blk.0." + s.name, s.dims})
	}
	ts := make([]gguf.WriteTensor, len(specs))
	for i, s := range specs {
		ts[i] = gguf.WriteTensor{Name: s.name, Dims: s.dims, Type: gguf.F32}
	}
	path := filepath.Join(t.TempDir(), "qwen2-tiny-f32.gguf")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	infos, err := gguf.Write(f, kvs, ts, func(i int, w io.Writer) error {
		b := make([]byte, 4*int(gguf.TensorInfo{Dims: ts[i].Dims}.Elements()))
		for j := range b {
			b[j] = byte(i*7 + j)
		}
		_, err := w.Write(b)
		return err
	})
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.ModelType != "qwen2" || cfg.Architecture != "Qwen2ForCausalLM" || !cfg.AttentionBias || cfg.TieEmbeddings ||
		cfg.HeadDim != hd || cfg.KVHeads != kv || cfg.Vocab != vocab || cfg.Rope.Theta != 1e6 || cfg.RopeFreqFactors != nil ||
		cfg.BOS != 5 || !reflect.DeepEqual(cfg.EOS, []int{7, 8}) || cfg.MaxPositions != 32768 {
		t.Fatalf("config %+v", cfg)
	}
	ck, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if err := ck.Check(cfg, 0, 0, true, true); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for i, name := range []string{LayerTensorName(0, QProj), LayerTensorName(0, KBias)} {
		tn, _ := ck.Tensor(name)
		info := infos[map[int]int{0: 4, 1: 7}[i]]
		off := int(ck.GGUF().DataOffset) + int(info.Offset)
		if !bytes.Equal(tn.Data, raw[off:off+int(info.Size)]) {
			t.Errorf("%s: qwen2 rows were reordered", name)
		}
	}
}

// Each GGUF variant of gocoder-6m is a variant of its own, labelled with
// llama.cpp's file type; the bf16 GGUF differs from the safetensors model
// too (its norms are f32, its RoPE comes as factors).
func TestGGUFVariants(t *testing.T) {
	seen := map[string]string{}
	for _, v := range []string{"bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m"} {
		path := testenv.GoCoderGGUF(t, v)
		ck, err := Open(path)
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := LoadConfig(path)
		if err != nil {
			t.Fatal(err)
		}
		got, err := VariantOf(ck, cfg, "")
		ck.Close()
		if err != nil {
			t.Fatal(err)
		}
		if !strings.EqualFold(got.Label, v) {
			t.Errorf("%s: label %q", v, got.Label)
		}
		if other, dup := seen[got.Fingerprint]; dup {
			t.Errorf("%s and %s share a fingerprint", v, other)
		}
		seen[got.Fingerprint] = v
	}
}

// A GGUF the hub fetched for layer 0 only (its sidecar says which bytes
// are on disk) loads layer 0 and refuses layer 1, whose bytes are holes,
// instead of running on zeros.
func TestGGUFPartialDownloadRefusesMissingTensors(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tiny.gguf")
	if _, err := SynthGGUF(context.Background(), path, SynthOptions{Shape: "tiny", Seed: 1}); err != nil {
		t.Fatal(err)
	}
	f, err := gguf.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	have := []ByteRange{{Start: 0, End: f.DataOffset}}
	for _, ti := range f.Tensors {
		if strings.HasPrefix(ti.Name, "blk.0.") || ti.Name == "token_embd.weight" || ti.Name == "rope_freqs.weight" {
			start := f.DataOffset + int64(ti.Offset)
			have = append(have, ByteRange{Start: start, End: start + int64(ti.Size)})
		}
	}
	f.Close()
	sc, _ := json.Marshal(GGUFSidecar{Size: f.Size, Have: mergeRanges(have)})
	if err := os.WriteFile(path+GGUFSidecarSuffix, sc, 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	ck, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if err := ck.Check(cfg, 0, 0, true, false); err != nil {
		t.Fatalf("layer 0 was downloaded: %v", err)
	}
	err = ck.Check(cfg, 1, 1, false, true)
	if err == nil || !strings.Contains(err.Error(), "was not downloaded") {
		t.Fatalf("layer 1 is holes: %v", err)
	}
	if _, err := ck.Tensor(LayerTensorName(1, UpProj)); err == nil {
		t.Fatal("a tensor of holes was handed out")
	}
	if _, err := ck.Info(LayerTensorName(1, UpProj)); err != nil {
		t.Fatalf("infos need no data: %v", err)
	}
}

// mergeRanges sorts and joins touching ranges, as the hub's sidecar has them.
func mergeRanges(in []ByteRange) []ByteRange {
	sort.Slice(in, func(i, j int) bool { return in[i].Start < in[j].Start })
	var out []ByteRange
	for _, r := range in {
		if n := len(out); n > 0 && r.Start <= out[n-1].End {
			out[n-1].End = max(out[n-1].End, r.End)
			continue
		}
		out = append(out, r)
	}
	return out
}
