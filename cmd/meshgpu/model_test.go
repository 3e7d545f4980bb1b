package main

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
)

// oneErrorLine checks a failed command's stderr: exactly one line naming the problem.
func oneErrorLine(t *testing.T, stderr string, code int, want string) {
	t.Helper()
	lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n")
	if code == 0 || len(lines) != 1 || !strings.HasPrefix(lines[0], "meshgpu: ") || !strings.Contains(lines[0], want) {
		t.Errorf("exit %d, stderr %q; want non-zero and one line with %q", code, stderr, want)
	}
}

func TestModelCLIBadInput(t *testing.T) {
	tmp := t.TempDir()
	tiny := filepath.Join(tmp, "tiny")
	if _, stderr, code := runMeshgpu(t, "--log-level", "error", "model", "synth", "--shape", "tiny", "--out", tiny); code != 0 {
		t.Fatalf("synth: exit %d: %s", code, stderr)
	}

	// Truncated safetensors.
	trunc := filepath.Join(tmp, "trunc")
	os.MkdirAll(trunc, 0o755)
	data, _ := os.ReadFile(filepath.Join(tiny, "model.safetensors"))
	cfg, _ := os.ReadFile(filepath.Join(tiny, "config.json"))
	os.WriteFile(filepath.Join(trunc, "model.safetensors"), data[:len(data)-1000], 0o644)
	os.WriteFile(filepath.Join(trunc, "config.json"), cfg, 0o644)
	_, stderr, code := runMeshgpu(t, "model", "inspect", trunc)
	oneErrorLine(t, stderr, code, "truncated")

	// Missing tensor: drop one from the header by renaming it.
	missing := filepath.Join(tmp, "missing")
	os.MkdirAll(missing, 0o755)
	n := binary.LittleEndian.Uint64(data)
	renamed := bytes.Clone(data)
	copy(renamed[8:8+n], bytes.Replace(renamed[8:8+n], []byte("model.layers.1.mlp.up_proj"), []byte("model.layers.1.mlp.up_prxj"), 1))
	os.WriteFile(filepath.Join(missing, "model.safetensors"), renamed, 0o644)
	os.WriteFile(filepath.Join(missing, "config.json"), cfg, 0o644)
	_, stderr, code = runMeshgpu(t, "model", "inspect", missing)
	oneErrorLine(t, stderr, code, `tensor "model.layers.1.mlp.up_proj.weight" is missing`)

	// Inconsistent head counts.
	os.WriteFile(filepath.Join(missing, "config.json"), bytes.Replace(cfg, []byte(`"num_key_value_heads": 2`), []byte(`"num_key_value_heads": 3`), 1), 0o644)
	_, stderr, code = runMeshgpu(t, "model", "inspect", missing)
	oneErrorLine(t, stderr, code, "num_key_value_heads 3")

	// Bad layer ranges.
	_, stderr, code = runMeshgpu(t, "model", "inspect", "--layers", "7-3", tiny)
	oneErrorLine(t, stderr, code, "reversed")
	_, stderr, code = runMeshgpu(t, "model", "inspect", "--layers", "0-2", tiny)
	oneErrorLine(t, stderr, code, "beyond the model: it has 2 layers")

	_, stderr, code = runMeshgpu(t, "model", "synth", "--shape", "huge", "--out", filepath.Join(tmp, "x"))
	oneErrorLine(t, stderr, code, `unknown shape "huge"`)
	_, stderr, code = runMeshgpu(t, "model", "synth", "--shape", "tiny", "--out", tiny)
	oneErrorLine(t, stderr, code, "already holds")
	_, stderr, code = runMeshgpu(t, "model", "inspect")
	oneErrorLine(t, stderr, code, "one model directory")

	// A good model inspects, as text and as JSON.
	out, stderr, code := runMeshgpu(t, "model", "inspect", "--json", tiny)
	var r struct {
		Layers, Hidden int
		Tensors        []struct{ Name string }
		HeadBytes      int64 `json:"head_bytes"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &r) != nil || r.Layers != 2 || r.Hidden != 64 || len(r.Tensors) != 21 || r.HeadBytes != 512*64*2 {
		t.Fatalf("inspect --json: exit %d, %+v, stderr %s", code, r, stderr)
	}
	// Layer 1 of 2 (untied): the layer, the final norm and the LM head.
	out, stderr, code = runMeshgpu(t, "model", "inspect", "--json", "--layers", "1", tiny)
	var rr struct {
		Range struct {
			Bytes      int64
			Embeddings bool
			Head       bool
		}
		Tensors []struct{ Name string }
	}
	layer := int64(64*2+(64*64+2*32*64+64*64)+3*64*128) * 2
	if code != 0 || json.Unmarshal([]byte(out), &rr) != nil || rr.Range.Bytes != layer+64*2+512*64*2 ||
		rr.Range.Embeddings || !rr.Range.Head || len(rr.Tensors) != 9+2 {
		t.Fatalf("inspect --layers 1: exit %d, %+v, stderr %s", code, rr, stderr)
	}
}

func TestModelCLIInspectGoCoder(t *testing.T) {
	dir := testenv.GoCoder(t)
	out, stderr, code := runMeshgpu(t, "model", "inspect", dir)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	flat := strings.Join(strings.Fields(out), " ") // tabwriter padding varies
	for _, want := range []string{"LlamaForCausalLM (llama)", "1508352", "model.layers.5.self_attn.k_proj.weight BF16 [64 256]", "llama3 theta=500000", "56 tensors", "variant bf16 "} {
		if !strings.Contains(flat, want) {
			t.Errorf("inspect output lacks %q:\n%s", want, out)
		}
	}
}
