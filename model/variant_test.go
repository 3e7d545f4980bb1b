package model

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
)

// rewrite copies src's tensors into a new directory (with src's config)
// with the dtypes dtypeOf gives; the data is zeros of the new size: only
// the infos matter to a variant.
func rewrite(t *testing.T, srcDir string, src *Checkpoint, dtypeOf func(name string, d DType) DType) (string, *Checkpoint) {
	t.Helper()
	dir := t.TempDir()
	var ts []Tensor
	for _, name := range src.Names() {
		in, err := src.Info(name)
		if err != nil {
			t.Fatal(err)
		}
		d := dtypeOf(name, in.DType)
		ts = append(ts, Tensor{Name: name, DType: d, Shape: in.Shape, Data: make([]byte, in.Elements()*int64(d.Size()))})
	}
	if err := WriteSafetensorsFile(filepath.Join(dir, singleFile), ts, nil); err != nil {
		t.Fatal(err)
	}
	cfg, err := os.ReadFile(filepath.Join(srcDir, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	ck, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ck.Close() })
	return dir, ck
}

func openVariant(t *testing.T, ck *Checkpoint, cfg *Config, label string) Variant {
	t.Helper()
	v, err := VariantOf(ck, cfg, label)
	if err != nil {
		t.Fatal(err)
	}
	if len(v.Fingerprint) != 64 || strings.Trim(v.Fingerprint, "0123456789abcdef") != "" {
		t.Fatalf("fingerprint %q is not 64 hex digits", v.Fingerprint)
	}
	return v
}

// gocoder-6m is "bf16"; the same tensors stored as f32 are another variant
// ("f32"); a config change that moves the numbers (rope theta) is another
// variant too; the label override changes the label only; the fingerprint
// is the same on every open.
func TestVariantOfGoCoder(t *testing.T) {
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
	bf := openVariant(t, ck, cfg, "")
	if bf.Label != "bf16" {
		t.Errorf("label %q, want bf16", bf.Label)
	}
	again, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	if v := openVariant(t, again, cfg, ""); v != bf {
		t.Errorf("a second open gives %+v, want %+v", v, bf)
	}
	if v := openVariant(t, ck, cfg, "Q4_K_M"); v.Label != "Q4_K_M" || v.Fingerprint != bf.Fingerprint {
		t.Errorf("label override: %+v", v)
	}
	if v := openVariant(t, ck, cfg, "a label/with spaces and far too long for the wire"); v.Label != "a_label_with_spaces_and_far_too_" {
		t.Errorf("label kept to the wire's characters and length: %q", v.Label)
	}

	_, f32 := rewrite(t, dir, ck, func(_ string, d DType) DType {
		if d == BF16 {
			return F32
		}
		return d
	})
	v32 := openVariant(t, f32, cfg, "")
	if v32.Label != "f32" || v32.Fingerprint == bf.Fingerprint {
		t.Errorf("f32 copy: %+v, bf16 %+v", v32, bf)
	}

	other := *cfg
	other.Rope.Theta *= 2
	if v := openVariant(t, ck, &other, ""); v.Fingerprint == bf.Fingerprint {
		t.Error("a different rope theta gives the same fingerprint")
	}
	other = *cfg
	other.EOS = append([]int{}, 1, 2, 3) // not numerics: the same variant
	if v := openVariant(t, ck, &other, ""); v.Fingerprint != bf.Fingerprint {
		t.Error("eos ids changed the fingerprint")
	}
}

// A mixed file is labelled by the dtype holding most elements of the
// layers' matrices (an embedding table in another dtype does not decide),
// and its per-layer sizes are each layer's own.
func TestVariantOfMixedDTypes(t *testing.T) {
	dir, cfg := synthTiny(t)
	src, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	// Layer 1's down projection in f32, the embeddings in f32, the rest of
	// the matrices in I8 (a stand-in for a quantized type), norms in f32.
	_, ck := rewrite(t, dir, src, func(name string, _ DType) DType {
		switch {
		case name == EmbedName || name == LMHeadName || strings.HasSuffix(name, "norm.weight"):
			return F32
		case name == LayerTensorName(1, DownProj):
			return F32
		}
		return "I8"
	})
	v := openVariant(t, ck, cfg, "")
	if v.Label != "I8" {
		t.Errorf("label %q, want I8", v.Label)
	}
	l0, err := LayerBytesStored(ck, cfg, 0)
	if err != nil {
		t.Fatal(err)
	}
	l1, err := LayerBytesStored(ck, cfg, 1)
	if err != nil {
		t.Fatal(err)
	}
	down := int64(cfg.Hidden) * int64(cfg.Intermediate)
	if l1-l0 != 3*down { // 4 bytes instead of 1 per element
		t.Errorf("layer bytes %d and %d: want a difference of %d", l0, l1, 3*down)
	}
	var want int64
	for _, s := range cfg.LayerTensors(0) {
		n := s.Elements()
		if strings.HasSuffix(s.Name, "norm.weight") {
			n *= 4
		}
		want += n
	}
	if l0 != want {
		t.Errorf("layer 0 holds %d bytes, want %d", l0, want)
	}
	emb, err := EmbedBytesStored(ck, cfg)
	if err != nil || emb != int64(cfg.Vocab)*int64(cfg.Hidden)*4 {
		t.Errorf("embed bytes %d, %v", emb, err)
	}
	head, err := HeadBytesStored(ck, cfg) // tiny has an untied head
	if err != nil || head != int64(cfg.Vocab)*int64(cfg.Hidden)*4+int64(cfg.Hidden)*4 {
		t.Errorf("head bytes %d, %v", head, err)
	}
}

// A sharded checkpoint missing a shard cannot name its variant (the other
// shards' tensors count too): an error naming the tensor, not a
// fingerprint no full node would share.
func TestVariantOfNeedsEveryShard(t *testing.T) {
	dir, cfg := synthTiny(t)
	one, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	var first, rest []string
	for _, name := range one.Names() {
		if strings.HasPrefix(name, LayerTensorName(0, "")) {
			first = append(first, name)
		} else {
			rest = append(rest, name)
		}
	}
	sharded := writeSharded(t, one, [][]string{first, rest})
	full, err := Open(sharded)
	if err != nil {
		t.Fatal(err)
	}
	defer full.Close()
	if v, w := openVariant(t, full, cfg, ""), openVariant(t, one, cfg, ""); v != w {
		t.Errorf("sharded %+v, single file %+v: the same tensors", v, w)
	}
	if err := os.Remove(filepath.Join(sharded, "model-00002-of-00002.safetensors")); err != nil {
		t.Fatal(err)
	}
	part, err := Open(sharded)
	if err != nil {
		t.Fatal(err)
	}
	defer part.Close()
	if _, err := VariantOf(part, cfg, ""); err == nil || !strings.Contains(err.Error(), "model-00002-of-00002") {
		t.Fatalf("a missing shard: %v", err)
	}
}
