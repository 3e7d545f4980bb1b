package model

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
)

// rawHeader reads a safetensors header with a plain JSON map, independent of
// the parser under test.
func rawHeader(t *testing.T, path string) (map[string]any, []byte, int) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n := int(binary.LittleEndian.Uint64(b))
	var h map[string]any
	if err := json.Unmarshal(b[8:8+n], &h); err != nil {
		t.Fatal(err)
	}
	delete(h, "__metadata__")
	return h, b, 8 + n
}

func TestOpenGoCoder(t *testing.T) {
	dir := testenv.GoCoder(t)
	ck, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	h, file, start := rawHeader(t, filepath.Join(dir, "model.safetensors"))
	names := ck.Names()
	if len(names) != len(h) || !sort.StringsAreSorted(names) {
		t.Fatalf("%d names (sorted %v), header has %d", len(names), sort.StringsAreSorted(names), len(h))
	}
	for _, name := range names {
		e := h[name].(map[string]any)
		tt, err := ck.Tensor(name)
		if err != nil {
			t.Fatal(err)
		}
		var shape []int
		for _, d := range e["shape"].([]any) {
			shape = append(shape, int(d.(float64)))
		}
		off := e["data_offsets"].([]any)
		want := file[start+int(off[0].(float64)) : start+int(off[1].(float64))]
		if string(tt.DType) != e["dtype"].(string) || !reflect.DeepEqual(tt.Shape, shape) || !bytes.Equal(tt.Data, want) {
			t.Fatalf("%s: got %s %v (%d bytes), header says %v %v", name, tt.DType, tt.Shape, len(tt.Data), e["dtype"], shape)
		}
	}
	cfg, err := LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	// Every tensor the config implies is there with its shape, and no more.
	if err := ck.Check(cfg, 0, cfg.NumLayers-1, true, true); err != nil {
		t.Fatal(err)
	}
	if n := len(cfg.Tensors(0, cfg.NumLayers-1, true, true)); n != len(names) {
		t.Fatalf("config implies %d tensors, checkpoint has %d", n, len(names))
	}
	if !ck.Has(LayerTensorName(5, KProj)) || ck.Has(LayerTensorName(6, KProj)) || ck.Has(LMHeadName) {
		t.Fatal("Has is wrong")
	}
	_, err = ck.Tensor(LMHeadName)
	if err == nil || !strings.Contains(err.Error(), `tensor "lm_head.weight" is missing`) {
		t.Fatalf("missing tensor: %v", err)
	}
	// A config with more layers than the checkpoint names the missing tensor.
	big := *cfg
	big.NumLayers = 7
	if err := ck.Check(&big, 6, 6, false, false); err == nil || !strings.Contains(err.Error(), "model.layers.6.") {
		t.Fatalf("Check with a missing layer: %v", err)
	}
	wrong := *cfg
	wrong.Intermediate = 512
	if err := ck.Check(&wrong, 0, 0, false, false); err == nil || !strings.Contains(err.Error(), "config.json implies") {
		t.Fatalf("Check with wrong shapes: %v", err)
	}
	ck.Close()
	if _, err := ck.Tensor(EmbedName); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Fatalf("after Close: %v", err)
	}
}

func TestOpenNotAModelDir(t *testing.T) {
	dir := t.TempDir()
	_, err := Open(dir)
	if err == nil || !strings.Contains(err.Error(), "no model.safetensors") {
		t.Fatalf("empty dir: %v", err)
	}
}

// synthTiny writes a tiny random model once per test.
func synthTiny(t *testing.T) (string, *Config) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "tiny")
	cfg, err := Synth(t.Context(), dir, SynthOptions{Shape: "tiny", Seed: 7})
	if err != nil {
		t.Fatal(err)
	}
	return dir, cfg
}

// writeSharded copies a checkpoint's tensors into shards of the given groups
// of names, with an index, into a new directory.
func writeSharded(t *testing.T, src *Checkpoint, groups [][]string) string {
	t.Helper()
	dir := t.TempDir()
	weightMap := map[string]string{}
	for i, g := range groups {
		file := fmt.Sprintf("model-%05d-of-%05d.safetensors", i+1, len(groups))
		var ts []Tensor
		for _, name := range g {
			tt, err := src.Tensor(name)
			if err != nil {
				t.Fatal(err)
			}
			ts = append(ts, tt)
			weightMap[name] = file
		}
		if err := WriteSafetensorsFile(filepath.Join(dir, file), ts, map[string]string{"format": "pt"}); err != nil {
			t.Fatal(err)
		}
	}
	idx, _ := json.Marshal(map[string]any{"metadata": map[string]any{"total_size": 0}, "weight_map": weightMap})
	if err := os.WriteFile(filepath.Join(dir, indexFile), idx, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestShardedMatchesSingleFile(t *testing.T) {
	dir, cfg := synthTiny(t)
	one, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	var first, second, rest []string
	for _, name := range one.Names() {
		switch {
		case name == EmbedName || strings.HasPrefix(name, LayerTensorName(0, "")):
			first = append(first, name)
		case strings.HasPrefix(name, LayerTensorName(1, "")):
			second = append(second, name)
		default:
			rest = append(rest, name)
		}
	}
	sdir := writeSharded(t, one, [][]string{first, second, rest})
	sh, err := Open(sdir)
	if err != nil {
		t.Fatal(err)
	}
	defer sh.Close()
	if !reflect.DeepEqual(sh.Names(), one.Names()) {
		t.Fatalf("names differ:\n%v\n%v", sh.Names(), one.Names())
	}
	for _, name := range one.Names() {
		a, _ := one.Tensor(name)
		b, err := sh.Tensor(name)
		if err != nil {
			t.Fatal(err)
		}
		if a.DType != b.DType || !reflect.DeepEqual(a.Shape, b.Shape) || !bytes.Equal(a.Data, b.Data) {
			t.Fatalf("%s differs between sharded and single-file checkpoints", name)
		}
	}
	if err := sh.Check(cfg, 0, cfg.NumLayers-1, true, true); err != nil {
		t.Fatal(err)
	}

	// Shards are opened only when needed: with shard 1 truncated, a node
	// holding layer 1 still loads, and asking for layer 0 names the bad file.
	shard1 := filepath.Join(sdir, "model-00001-of-00003.safetensors")
	if err := os.Truncate(shard1, 100); err != nil {
		t.Fatal(err)
	}
	lazy, err := Open(sdir)
	if err != nil {
		t.Fatal(err)
	}
	defer lazy.Close()
	if err := lazy.Check(cfg, 1, 1, false, true); err != nil {
		t.Fatalf("layer 1 and the head should not need shard 1: %v", err)
	}
	_, err = lazy.Tensor(LayerTensorName(0, QProj))
	if err == nil || !strings.Contains(err.Error(), shard1) {
		t.Fatalf("truncated shard: %v", err)
	}
}

func TestShardIndexBadInput(t *testing.T) {
	dir, _ := synthTiny(t)
	one, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	sdir := writeSharded(t, one, [][]string{one.Names()})
	write := func(s string) {
		if err := os.WriteFile(filepath.Join(sdir, indexFile), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cases := []struct{ index, want string }{
		{`{"weight_map":{"x":"../model.safetensors"}}`, "not a file name in the model directory"},
		{`{"weight_map":{"x":"/etc/passwd"}}`, "not a file name"},
		{`{"weight_map":{}}`, "weight_map is missing or empty"},
		{`{"weight_map":`, "not a valid index"},
	}
	for _, tc := range cases {
		write(tc.index)
		_, err := Open(sdir)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("index %s: %v, want %q", tc.index, err, tc.want)
		}
	}
	// A shard that is absent fails when needed, naming the file.
	write(`{"weight_map":{"x":"model-00009-of-00009.safetensors"}}`)
	ck, err := Open(sdir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ck.Tensor("x"); err == nil || !strings.Contains(err.Error(), "model-00009-of-00009.safetensors") {
		t.Fatalf("absent shard: %v", err)
	}
	ck.Close()
	// The index places a tensor in a shard that lacks it.
	write(`{"weight_map":{"model.embed_tokens.weight":"model-00001-of-00001.safetensors","ghost":"model-00001-of-00001.safetensors"}}`)
	ck, err = Open(sdir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if _, err := ck.Tensor("ghost"); err == nil || !strings.Contains(err.Error(), `"ghost" is missing`) {
		t.Fatalf("ghost tensor: %v", err)
	}
}

func TestF16AndF32Tensors(t *testing.T) {
	dir := t.TempDir()
	f32 := []float32{1.5, -2.25, 3e-3, 65504, 0, -0.125}
	f32b := make([]byte, 4*len(f32))
	for i, v := range f32 {
		binary.LittleEndian.PutUint32(f32b[4*i:], math.Float32bits(v))
	}
	// IEEE half bit patterns of 1, -2, 0.5, 65504 (max half).
	f16b := []byte{0x00, 0x3C, 0x00, 0xC0, 0x00, 0x38, 0xFF, 0x7B}
	bf16b := []byte{0x80, 0x3F, 0x00, 0xC0} // 1, -2
	err := WriteSafetensorsFile(filepath.Join(dir, "model.safetensors"), []Tensor{
		{Name: "a.f32", DType: F32, Shape: []int{2, 3}, Data: f32b},
		{Name: "b.f16", DType: F16, Shape: []int{4}, Data: f16b},
		{Name: "c.bf16", DType: BF16, Shape: []int{1, 2}, Data: bf16b},
		{Name: "d.scalar", DType: F32, Shape: []int{}, Data: f32b[:4]},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ck, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	a, err := ck.Tensor("a.f32")
	if err != nil || a.DType != F32 || !reflect.DeepEqual(a.Shape, []int{2, 3}) || a.Elements() != 6 {
		t.Fatalf("a: %+v %v", a, err)
	}
	for i, v := range f32 {
		if got := math.Float32frombits(binary.LittleEndian.Uint32(a.Data[4*i:])); got != v {
			t.Errorf("a[%d] = %v, want %v", i, got, v)
		}
	}
	b, err := ck.Tensor("b.f16")
	if err != nil || b.DType != F16 || !bytes.Equal(b.Data, f16b) {
		t.Fatalf("b: %+v %v", b, err)
	}
	c, err := ck.Tensor("c.bf16")
	if err != nil || c.DType != BF16 || !bytes.Equal(c.Data, bf16b) {
		t.Fatalf("c: %+v %v", c, err)
	}
	d, err := ck.Tensor("d.scalar")
	if err != nil || len(d.Shape) != 0 || d.Elements() != 1 || !bytes.Equal(d.Data, f32b[:4]) {
		t.Fatalf("d: %+v %v", d, err)
	}
	// Data is capped to the tensor, so an append cannot write into the map.
	if cap(b.Data) != len(b.Data) {
		t.Fatal("Data capacity runs past the tensor")
	}
}

// TestTensorRacingClose: Tensor calls racing Close either get the tensor
// or a "closed" error; neither panics nor races (run with -race).
func TestTensorRacingClose(t *testing.T) {
	dir := t.TempDir()
	var ts []Tensor
	for i := 0; i < 64; i++ {
		ts = append(ts, Tensor{Name: fmt.Sprintf("t%d", i), DType: F32, Shape: []int{4}, Data: make([]byte, 16)})
	}
	if err := WriteSafetensorsFile(filepath.Join(dir, "model.safetensors"), ts, nil); err != nil {
		t.Fatal(err)
	}
	for round := 0; round < 50; round++ {
		ck, err := Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			for _, x := range ts {
				if _, err := ck.Tensor(x.Name); err != nil && !strings.Contains(err.Error(), "closed") {
					t.Error(err)
					return
				}
			}
		}()
		ck.Close()
		<-done
	}
}
