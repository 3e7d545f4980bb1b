package hub

import (
	"bytes"
	"context"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/model"
)

// fakeHub serves a hub-shaped tree for one repository: the tree API and
// resolve URLs with Range support, plus faults to inject.
type fakeHub struct {
	repo    string
	files   map[string][]byte
	token   string            // required bearer token, if set
	badSHA  map[string]string // advertised sha256 overrides
	cutOnce map[string]int64  // cut the first transfer of a file after n bytes
	// cdnEtag, when set, lists .safetensors files without checksums and
	// redirects them to /cdn/ with this X-Linked-Etag, as the hub does.
	cdnEtag func(data []byte) string

	mu       sync.Mutex
	requests []string // "file range"
}

func (h *fakeHub) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if h.token != "" && r.Header.Get("Authorization") != "Bearer "+h.token {
		http.Error(w, "unauthorized", http.StatusUnauthorized)
		return
	}
	if rest, ok := strings.CutPrefix(r.URL.Path, "/api/models/"+h.repo+"/tree/main"); ok && rest == "" {
		var list []map[string]any
		for name, data := range h.files {
			sum := sha1.New()
			fmt.Fprintf(sum, "blob %d\x00", len(data))
			sum.Write(data)
			e := map[string]any{"type": "file", "path": name, "size": len(data), "oid": hex.EncodeToString(sum.Sum(nil))}
			if strings.HasSuffix(name, ".safetensors") && h.cdnEtag != nil {
				delete(e, "oid")
			} else if strings.HasSuffix(name, ".safetensors") {
				sha := sha256.Sum256(data)
				oid := hex.EncodeToString(sha[:])
				if bad, ok := h.badSHA[name]; ok {
					oid = bad
				}
				e["lfs"] = map[string]any{"oid": oid, "size": len(data)}
			}
			list = append(list, e)
		}
		list = append(list, map[string]any{"type": "directory", "path": "original"},
			map[string]any{"type": "file", "path": "../escape", "size": 1})
		json.NewEncoder(w).Encode(list)
		return
	}
	name, ok := strings.CutPrefix(r.URL.Path, "/"+h.repo+"/resolve/main/")
	if h.cdnEtag != nil && ok && strings.HasSuffix(name, ".safetensors") {
		w.Header().Set("X-Linked-Etag", `"`+h.cdnEtag(h.files[name])+`"`)
		http.Redirect(w, r, "/cdn/"+name, http.StatusFound)
		return
	}
	if cdn, isCDN := strings.CutPrefix(r.URL.Path, "/cdn/"); isCDN && h.cdnEtag != nil {
		name, ok = cdn, true
	}
	data, found := h.files[name]
	if !ok || !found {
		http.NotFound(w, r)
		return
	}
	h.mu.Lock()
	h.requests = append(h.requests, name+" "+r.Header.Get("Range"))
	cut, doCut := h.cutOnce[name]
	delete(h.cutOnce, name)
	h.mu.Unlock()
	if doCut {
		// Promise the whole file, send part of it, drop the connection.
		w.Header().Set("Content-Length", fmt.Sprint(len(data)))
		w.WriteHeader(http.StatusOK)
		w.Write(data[:cut])
		w.(http.Flusher).Flush()
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			conn.Close()
		}
		return
	}
	http.ServeContent(w, r, name, time.Time{}, bytes.NewReader(data))
}

func (h *fakeHub) fileRequests() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.requests...)
}

// tinyRepo synthesizes a tiny model and returns its files, optionally with
// the checkpoint split into shards (embed+layer 0, layer 1, norm+head).
func tinyRepo(t *testing.T, sharded bool) map[string][]byte {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "m")
	if _, err := model.Synth(t.Context(), dir, model.SynthOptions{Shape: "tiny", Seed: 3}); err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{}
	for _, f := range []string{"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} {
		files[f], _ = os.ReadFile(filepath.Join(dir, f))
	}
	files["README.md"] = []byte("not fetched")
	if !sharded {
		files["model.safetensors"], _ = os.ReadFile(filepath.Join(dir, "model.safetensors"))
		return files
	}
	ck, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	groups := map[string][]model.Tensor{}
	weightMap := map[string]string{}
	for _, name := range ck.Names() {
		shard := "model-00003-of-00003.safetensors"
		switch {
		case name == model.EmbedName || strings.HasPrefix(name, model.LayerTensorName(0, "")):
			shard = "model-00001-of-00003.safetensors"
		case strings.HasPrefix(name, model.LayerTensorName(1, "")):
			shard = "model-00002-of-00003.safetensors"
		}
		tt, _ := ck.Tensor(name)
		groups[shard] = append(groups[shard], tt)
		weightMap[name] = shard
	}
	for shard, ts := range groups {
		p := filepath.Join(t.TempDir(), shard)
		if err := model.WriteSafetensorsFile(p, ts, nil); err != nil {
			t.Fatal(err)
		}
		files[shard], _ = os.ReadFile(p)
	}
	files["model.safetensors.index.json"], _ = json.Marshal(map[string]any{"weight_map": weightMap})
	return files
}

// serve starts the fake hub and returns options pointing at it.
func serve(t *testing.T, h *fakeHub) Options {
	t.Helper()
	srv := httptest.NewServer(h)
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(func() {
		client.CloseIdleConnections()
		srv.Close()
	})
	return Options{Endpoint: srv.URL, CacheDir: t.TempDir(), Client: client, Token: "-"}
}

// checkNoLeak compares goroutine counts with a short settle loop.
func checkNoLeak(t *testing.T, before int) {
	t.Helper()
	for i := 0; i < 100 && runtime.NumGoroutine() > before; i++ {
		time.Sleep(10 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before {
		t.Errorf("%d goroutines after, %d before", n, before)
	}
}

func TestDownloadFetchesModelFilesAndCaches(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Cleanup(func() { checkNoLeak(t, before) }) // runs after serve's cleanup
	h := &fakeHub{repo: "org/tiny", files: tinyRepo(t, false)}
	opts := serve(t, h)
	opts.Token = ""
	var progressed bool
	opts.Progress = func(file string, done, total int64) {
		progressed = progressed || (file == "model.safetensors" && done == total)
	}
	dir, err := Download(t.Context(), "org/tiny", opts)
	if err != nil {
		t.Fatal(err)
	}
	for name, data := range h.files {
		got, err := os.ReadFile(filepath.Join(dir, name))
		if name == "README.md" {
			if err == nil {
				t.Error("README.md was fetched")
			}
			continue
		}
		if !bytes.Equal(got, data) {
			t.Errorf("%s differs from the hub's (%v)", name, err)
		}
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(opts.CacheDir), "escape")); err == nil {
		t.Error("a ../ path escaped the cache")
	}
	if !progressed {
		t.Error("no progress reported")
	}
	if _, err := model.LoadConfig(dir); err != nil {
		t.Fatal(err)
	}
	ck, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	ck.Close()
	n := len(h.fileRequests())
	if _, err := Download(t.Context(), "org/tiny", opts); err != nil {
		t.Fatal(err)
	}
	if len(h.fileRequests()) != n {
		t.Errorf("second download fetched again: %v", h.fileRequests()[n:])
	}
}

func TestDownloadResumesAfterCutConnection(t *testing.T) {
	files := tinyRepo(t, false)
	cut := int64(len(files["model.safetensors"]) / 3)
	h := &fakeHub{repo: "org/tiny", files: files, cutOnce: map[string]int64{"model.safetensors": cut}}
	opts := serve(t, h)
	dir, err := Download(t.Context(), "org/tiny", opts)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, "model.safetensors"))
	if !bytes.Equal(got, files["model.safetensors"]) {
		t.Fatal("resumed file differs")
	}
	var weights []string
	for _, r := range h.fileRequests() {
		if strings.HasPrefix(r, "model.safetensors ") {
			weights = append(weights, r)
		}
	}
	want := []string{"model.safetensors ", fmt.Sprintf("model.safetensors bytes=%d-", cut)}
	if strings.Join(weights, "|") != strings.Join(want, "|") {
		t.Fatalf("requests %q, want %q", weights, want)
	}

	// A partial file left by a killed run is resumed by the next one.
	h2 := &fakeHub{repo: "org/tiny", files: files}
	opts2 := serve(t, h2)
	cacheDir := filepath.Join(opts2.CacheDir, "org--tiny", "main")
	os.MkdirAll(cacheDir, 0o755)
	os.WriteFile(filepath.Join(cacheDir, "model.safetensors.incomplete"), files["model.safetensors"][:1000], 0o644)
	if _, err := Download(t.Context(), "org/tiny", opts2); err != nil {
		t.Fatal(err)
	}
	got, _ = os.ReadFile(filepath.Join(cacheDir, "model.safetensors"))
	if !bytes.Equal(got, files["model.safetensors"]) || !contains(h2.fileRequests(), "model.safetensors bytes=1000-") {
		t.Fatalf("resume across runs: %v", h2.fileRequests())
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func TestDownloadRejectsChecksumMismatch(t *testing.T) {
	files := tinyRepo(t, false)
	other := sha256.Sum256([]byte("something else"))
	h := &fakeHub{repo: "org/tiny", files: files, badSHA: map[string]string{"model.safetensors": hex.EncodeToString(other[:])}}
	opts := serve(t, h)
	_, err := Download(t.Context(), "org/tiny", opts)
	if err == nil || !strings.Contains(err.Error(), "checksum mismatch") || !strings.Contains(err.Error(), "model.safetensors") {
		t.Fatalf("error %v, want a checksum mismatch naming the file", err)
	}
	dir := filepath.Join(opts.CacheDir, "org--tiny", "main")
	for _, f := range []string{"model.safetensors", "model.safetensors.incomplete"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
			t.Errorf("%s left in the cache", f)
		}
	}
	// A small file whose bytes disagree with the listed git blob sha1 fails
	// the same way.
	good := files["config.json"]
	h2 := &fakeHub{repo: "org/tiny", files: files}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/resolve/main/config.json") {
			w.Write(bytes.Replace(good, []byte("{"), []byte("["), 1))
			return
		}
		h2.ServeHTTP(w, r)
	}))
	defer srv.Close()
	_, err = Download(t.Context(), "org/tiny", Options{Endpoint: srv.URL, CacheDir: t.TempDir(), Token: "-"})
	if err == nil || !strings.Contains(err.Error(), "config.json: checksum mismatch") {
		t.Fatalf("small file: %v", err)
	}
}

func TestDownloadChecksLinkedEtag(t *testing.T) {
	files := tinyRepo(t, false)
	right := func(data []byte) string { s := sha256.Sum256(data); return hex.EncodeToString(s[:]) }
	h := &fakeHub{repo: "org/tiny", files: files, cdnEtag: right}
	if _, err := Download(t.Context(), "org/tiny", serve(t, h)); err != nil {
		t.Fatal(err)
	}
	if !contains(h.fileRequests(), "model.safetensors ") {
		t.Fatalf("the CDN was not asked: %v", h.fileRequests())
	}
	wrong := func([]byte) string { return right([]byte("other")) }
	h = &fakeHub{repo: "org/tiny", files: files, cdnEtag: wrong}
	if _, err := Download(t.Context(), "org/tiny", serve(t, h)); err == nil || !strings.Contains(err.Error(), "checksum mismatch") {
		t.Fatalf("wrong X-Linked-Etag: %v", err)
	}
}

func TestDownloadOnlyNeededShards(t *testing.T) {
	files := tinyRepo(t, true)
	for _, tc := range []struct {
		layers string
		want   []string
	}{
		{"0-0", []string{"model-00001-of-00003.safetensors"}},
		{"1", []string{"model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"}},
		{"", []string{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"}},
	} {
		h := &fakeHub{repo: "org/tiny", files: files}
		opts := serve(t, h)
		opts.Layers = tc.layers
		dir, err := Download(t.Context(), "org/tiny", opts)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, r := range h.fileRequests() {
			if strings.HasPrefix(r, "model-") {
				got = append(got, strings.TrimSpace(r))
			}
		}
		sort.Strings(got)
		if strings.Join(got, ",") != strings.Join(tc.want, ",") {
			t.Errorf("layers %q fetched %v, want %v", tc.layers, got, tc.want)
		}
		// What was fetched is enough for a node holding those layers.
		cfg, _ := model.LoadConfig(dir)
		first, last := 0, cfg.NumLayers-1
		if tc.layers != "" {
			first, last, _ = model.ParseLayers(tc.layers, cfg.NumLayers)
		}
		ck, err := model.Open(dir)
		if err == nil {
			err = ck.Check(cfg, first, last, first == 0, last == cfg.NumLayers-1)
			ck.Close()
		}
		if err != nil {
			t.Errorf("layers %q: %v", tc.layers, err)
		}
	}
	h := &fakeHub{repo: "org/tiny", files: files}
	opts := serve(t, h)
	opts.Layers = "7-3"
	if _, err := Download(t.Context(), "org/tiny", opts); err == nil || !strings.Contains(err.Error(), "reversed") {
		t.Errorf("bad layer range: %v", err)
	}
}

func TestDownloadTokenAndBadInput(t *testing.T) {
	h := &fakeHub{repo: "org/tiny", files: tinyRepo(t, false), token: "secret"}
	opts := serve(t, h)
	opts.Token = ""
	t.Setenv("HF_TOKEN", "")
	if _, err := Download(t.Context(), "org/tiny", opts); err == nil || !strings.Contains(err.Error(), "HF_TOKEN") {
		t.Fatalf("no token: %v", err)
	}
	t.Setenv("HF_TOKEN", "secret")
	if _, err := Download(t.Context(), "org/tiny", opts); err != nil {
		t.Fatalf("HF_TOKEN from the environment: %v", err)
	}
	opts.Token = "secret"
	if _, err := Download(t.Context(), "org/missing", opts); err == nil || !strings.Contains(err.Error(), "404") {
		t.Fatalf("missing repo: %v", err)
	}
	for _, repo := range []string{"../etc", "org", "org/na/me", "org/..", "", "org/-x"} {
		if _, err := Download(t.Context(), repo, opts); err == nil || !strings.Contains(err.Error(), "not a repository id") {
			t.Errorf("repo %q: %v", repo, err)
		}
	}
	opts.Revision = "../main"
	if _, err := Download(t.Context(), "org/tiny", opts); err == nil || !strings.Contains(err.Error(), "revision") {
		t.Errorf("bad revision: %v", err)
	}
	local := t.TempDir()
	if dir, err := Resolve(t.Context(), local, opts); err != nil || dir != local {
		t.Errorf("Resolve(local dir) = %q, %v", dir, err)
	}
	if _, err := Resolve(t.Context(), "no/such/dir", opts); err == nil || !strings.Contains(err.Error(), "neither a directory") {
		t.Errorf("Resolve(bad) = %v", err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	opts.Revision = ""
	opts.CacheDir = t.TempDir()
	if _, err := Download(ctx, "org/tiny", opts); err == nil {
		t.Error("cancelled download succeeded")
	}
}
