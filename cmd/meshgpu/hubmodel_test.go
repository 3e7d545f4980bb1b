package main

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"meshgpu/internal/testenv"
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
