package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/model/gguf"
)

// `generate --model org/name` downloads the repository from the hub
// ($HF_ENDPOINT, here a local server shaped like the hub serving
// gocoder-6m, with $HF_TOKEN) into $MESHGPU_CACHE_DIR and generates HF's
// greedy text from it; a second run uses the cache.
func TestGenerateCLIFromHubRepoID(t *testing.T) {
	dir := testenv.GoCoder(t)
	gen := readGoldenGen(t, dir).Generations[1]
	type listed struct {
		Type string `json:"type"`
		Path string `json:"path"`
		Size int64  `json:"size"`
		LFS  struct {
			OID  string `json:"oid"`
			Size int64  `json:"size"`
		} `json:"lfs"`
	}
	var tree []listed
	for _, name := range []string{"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "model.safetensors"} {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			continue
		}
		sum := sha256.Sum256(b)
		e := listed{Type: "file", Path: name, Size: int64(len(b))}
		e.LFS.OID, e.LFS.Size = hex.EncodeToString(sum[:]), int64(len(b))
		tree = append(tree, e)
	}
	var files atomic.Int64
	hubSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer hf_test" {
			http.Error(w, "gated", http.StatusUnauthorized)
			return
		}
		switch {
		case r.URL.Path == "/api/models/acme/gocoder/tree/main":
			json.NewEncoder(w).Encode(tree)
		case strings.HasPrefix(r.URL.Path, "/acme/gocoder/resolve/main/"):
			name := strings.TrimPrefix(r.URL.Path, "/acme/gocoder/resolve/main/")
			if strings.Contains(name, "/") {
				http.NotFound(w, r)
				return
			}
			files.Add(1)
			http.ServeFile(w, r, filepath.Join(dir, name))
		default:
			http.NotFound(w, r)
		}
	}))
	defer hubSrv.Close()
	t.Setenv("HF_ENDPOINT", hubSrv.URL)
	t.Setenv("HF_TOKEN", "hf_test")
	t.Setenv("MESHGPU_CACHE_DIR", t.TempDir())

	for run := 0; run < 2; run++ {
		stdout, stderr, code := runMeshgpu(t, "generate", "--model", "acme/gocoder", "--prompt", gen.Prompt, "-n", "64", "--ignore-eos", "--backend", "cpu")
		if code != 0 {
			t.Fatalf("run %d: exit %d: %s", run, code, stderr)
		}
		if stdout != gen.FP32.GreedyText+"\n" {
			t.Errorf("run %d: stdout %q, want golden greedy text %q", run, stdout, gen.FP32.GreedyText)
		}
		if n := files.Load(); n != int64(len(tree)) {
			t.Errorf("after run %d the hub served %d files, want %d (each once)", run, n, len(tree))
		}
	}

	t.Setenv("HF_TOKEN", "")
	t.Setenv("MESHGPU_CACHE_DIR", t.TempDir())
	_, stderr, code := runMeshgpu(t, "generate", "--model", "acme/gocoder", "--prompt", "x", "--backend", "cpu")
	if code != 1 || !strings.Contains(stderr, "HF_TOKEN") || strings.Count(strings.TrimSpace(stderr), "\n") != 0 {
		t.Errorf("gated repository without a token: exit %d, stderr %q; want one line naming HF_TOKEN", code, stderr)
	}
}

// --model org/name:TAG and org/name/file.gguf resolve, through the hub at
// $HF_ENDPOINT, to the .gguf file in $MESHGPU_CACHE_DIR, holding the
// tensors of the node's layers; a local .gguf path stays itself.
func TestModelDirHubGGUF(t *testing.T) {
	tensors := []gguf.WriteTensor{{Name: "token_embd.weight", Dims: []uint64{32, 16}, Type: gguf.F32}}
	for i := range 4 {
		tensors = append(tensors, gguf.WriteTensor{Name: fmt.Sprintf("blk.%d.attn_q.weight", i), Dims: []uint64{32, 32}, Type: gguf.F32})
	}
	tensors = append(tensors, gguf.WriteTensor{Name: "output_norm.weight", Dims: []uint64{32}, Type: gguf.F32})
	kv := []gguf.KV{{Key: "general.architecture", Value: gguf.String("llama")}, {Key: "llama.block_count", Value: gguf.Uint32(4)}}
	var file bytes.Buffer
	if _, err := gguf.Write(&file, kv, tensors, func(i int, w io.Writer) error {
		ti := tensors[i]
		n := 4 * ti.Dims[0]
		if len(ti.Dims) > 1 {
			n *= ti.Dims[1]
		}
		_, err := w.Write(bytes.Repeat([]byte{byte(i + 1)}, int(n)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	const name = "tiny-Q8_0.gguf"
	sum := sha256.Sum256(file.Bytes())
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/api/models/acme/tiny-GGUF/tree/main":
			json.NewEncoder(w).Encode([]map[string]any{{"type": "file", "path": name, "size": file.Len(),
				"lfs": map[string]any{"oid": hex.EncodeToString(sum[:]), "size": file.Len()}}})
		case "/acme/tiny-GGUF/resolve/main/" + name:
			http.ServeContent(w, r, name, time.Time{}, bytes.NewReader(file.Bytes()))
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	t.Setenv("HF_ENDPOINT", srv.URL)
	t.Setenv("HF_TOKEN", "")
	cache := t.TempDir()
	t.Setenv("MESHGPU_CACHE_DIR", cache)
	want := filepath.Join(cache, "acme--tiny-GGUF", "main", name)
	for _, arg := range []string{"acme/tiny-GGUF:q8_0", "acme/tiny-GGUF/" + name} {
		got, err := modelDir(t.Context(), arg, "1-2")
		if err != nil || got != want {
			t.Fatalf("modelDir(%q) = %q, %v; want %q", arg, got, err, want)
		}
		m, err := gguf.Open(got)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range []string{"blk.1.attn_q.weight", "blk.2.attn_q.weight"} {
			ti, _ := m.Tensor(n)
			if data, _ := m.Data(ti); data[0] == 0 {
				t.Errorf("%s: tensor %s was not fetched", arg, n)
			}
		}
		m.Close()
	}
	if _, err := modelDir(t.Context(), "acme/tiny-GGUF:Q4_K_M", ""); err == nil || !strings.Contains(err.Error(), "Q8_0") {
		t.Errorf("a tag the repository lacks: %v, want the available ones listed", err)
	}
	// A local file whose path could be a hub reference is the local file.
	t.Chdir(t.TempDir())
	os.MkdirAll("acme/tiny-GGUF", 0o755)
	os.WriteFile("acme/tiny-GGUF/"+name, file.Bytes(), 0o644)
	if got, err := modelDir(t.Context(), "acme/tiny-GGUF/"+name, ""); err != nil || got != "acme/tiny-GGUF/"+name {
		t.Errorf("local .gguf: %q, %v", got, err)
	}
}
