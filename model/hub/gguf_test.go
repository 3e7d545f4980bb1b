package hub

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/model/gguf"
)

// llamaKV is the metadata of a llama.cpp Llama with blocks layers and a
// vocabulary big enough that the header outgrows a small first prefix.
func llamaKV(blocks int) []gguf.KV {
	tokens := make([]string, 3000)
	for i := range tokens {
		tokens[i] = fmt.Sprintf("tok%d", i)
	}
	return []gguf.KV{
		{Key: "general.architecture", Value: gguf.String("llama")},
		{Key: "general.name", Value: gguf.String("test")},
		{Key: "llama.block_count", Value: gguf.Uint32(uint32(blocks))},
		{Key: "llama.embedding_length", Value: gguf.Uint32(128)},
		{Key: "tokenizer.ggml.tokens", Value: gguf.Strings(tokens)},
	}
}

// llamaTensors is a Llama's tensors in llama.cpp's file order, tiny but of
// the real shapes' kinds; ffn_down is Q8_0, whose 34-byte blocks leave
// alignment padding between tensors as real files have.
func llamaTensors(blocks int, tied bool) []gguf.WriteTensor {
	ts := []gguf.WriteTensor{{Name: "token_embd.weight", Dims: []uint64{128, 256}, Type: gguf.Q8_0}}
	for i := range blocks {
		b := fmt.Sprintf("blk.%d.", i)
		ts = append(ts,
			gguf.WriteTensor{Name: b + "attn_norm.weight", Dims: []uint64{128}, Type: gguf.F32},
			gguf.WriteTensor{Name: b + "attn_q.weight", Dims: []uint64{128, 128}, Type: gguf.F16},
			gguf.WriteTensor{Name: b + "attn_k.weight", Dims: []uint64{128, 32}, Type: gguf.F16},
			gguf.WriteTensor{Name: b + "attn_v.weight", Dims: []uint64{128, 32}, Type: gguf.F16},
			gguf.WriteTensor{Name: b + "attn_output.weight", Dims: []uint64{128, 128}, Type: gguf.F16},
			gguf.WriteTensor{Name: b + "ffn_norm.weight", Dims: []uint64{128}, Type: gguf.F32},
			gguf.WriteTensor{Name: b + "ffn_gate.weight", Dims: []uint64{128, 256}, Type: gguf.F16},
			gguf.WriteTensor{Name: b + "ffn_up.weight", Dims: []uint64{128, 256}, Type: gguf.F16},
			gguf.WriteTensor{Name: b + "ffn_down.weight", Dims: []uint64{256, 128}, Type: gguf.Q8_0},
		)
	}
	ts = append(ts, gguf.WriteTensor{Name: "output_norm.weight", Dims: []uint64{128}, Type: gguf.F32})
	if !tied {
		ts = append(ts, gguf.WriteTensor{Name: "output.weight", Dims: []uint64{128, 256}, Type: gguf.Q8_0})
	}
	return ts
}

// writeGGUF writes a GGUF whose tensors hold random bytes seeded by their
// names, and returns the file and its parsed header.
func writeGGUF(t *testing.T, kv []gguf.KV, tensors []gguf.WriteTensor) ([]byte, *gguf.File) {
	t.Helper()
	var buf bytes.Buffer
	infos, err := gguf.Write(&buf, kv, tensors, func(i int, w io.Writer) error {
		seed := fnv.New64a()
		seed.Write([]byte(tensors[i].Name))
		rng := rand.New(rand.NewPCG(seed.Sum64(), 1))
		row, _ := tensors[i].Type.RowBytes(tensors[i].Dims[0])
		size := row
		for _, d := range tensors[i].Dims[1:] {
			size *= d
		}
		data := make([]byte, size)
		for j := range data {
			data[j] = byte(rng.Uint32()) | 1 // never 0, so a hole is told apart
		}
		_, err := w.Write(data)
		return err
	})
	if err != nil || len(infos) != len(tensors) {
		t.Fatal(err)
	}
	f, err := gguf.Parse(bytes.NewReader(buf.Bytes()), int64(buf.Len()))
	if err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), f
}

// ggufHub serves a repository of files with the hub's listing and resolve
// URLs, answering Range requests, and counts the file bytes it sends.
type ggufHub struct {
	repo   string
	files  map[string][]byte
	listed map[string]int64 // listing size overrides
	tamper map[string]int64 // serve this byte changed; the listing keeps the true sha256
	cutAt  map[string]int64 // the first response covering this offset is cut there
	// stallAt: the first response covering this offset sends the bytes
	// before it, then waits for the client to go away.
	stallAt map[string]int64
	refuse  map[string]int // answer every request for the file with this status

	mu     sync.Mutex
	served int64    // file bytes sent
	ranges []string // "file range" of each file request
}

func (h *ggufHub) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/api/models/"+h.repo+"/tree/main" {
		var list []map[string]any
		for name, data := range h.files {
			size := int64(len(data))
			if n, ok := h.listed[name]; ok {
				size = n
			}
			e := map[string]any{"type": "file", "path": name, "size": size}
			if strings.HasSuffix(name, ".gguf") {
				sum := sha256.Sum256(data)
				e["lfs"] = map[string]any{"oid": hex.EncodeToString(sum[:]), "size": size}
			}
			list = append(list, e)
		}
		json.NewEncoder(w).Encode(list)
		return
	}
	name, ok := strings.CutPrefix(r.URL.Path, "/"+h.repo+"/resolve/main/")
	data, found := h.files[name]
	if !ok || !found {
		http.NotFound(w, r)
		return
	}
	h.mu.Lock()
	h.ranges = append(h.ranges, name+" "+r.Header.Get("Range"))
	status := h.refuse[name]
	cut, doCut := h.cutAt[name]
	stall := false
	if at, ok := h.stallAt[name]; ok && !doCut {
		cut, doCut, stall = at, true, true
	}
	var first, last int64
	if doCut {
		n, _ := fmt.Sscanf(r.Header.Get("Range"), "bytes=%d-%d", &first, &last)
		doCut = n == 2 && first < cut && cut <= last
		if doCut {
			delete(h.cutAt, name)
			delete(h.stallAt, name)
		}
	}
	h.mu.Unlock()
	if status != 0 {
		w.Header().Set("Content-Range", fmt.Sprintf("bytes */%d", len(data)))
		http.Error(w, http.StatusText(status), status)
		return
	}
	if at, ok := h.tamper[name]; ok {
		data = bytes.Clone(data)
		data[at] ^= 0x40
	}
	if doCut {
		// Promise the range, send part of it, drop the connection.
		w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", first, last, len(data)))
		w.Header().Set("Content-Length", fmt.Sprint(last-first+1))
		w.WriteHeader(http.StatusPartialContent)
		n, _ := w.Write(data[first:cut])
		h.count(n)
		w.(http.Flusher).Flush()
		if stall {
			<-r.Context().Done()
			return
		}
		if conn, _, err := w.(http.Hijacker).Hijack(); err == nil {
			conn.Close()
		}
		return
	}
	http.ServeContent(countingWriter{w, h}, r, name, time.Time{}, bytes.NewReader(data))
}

func (h *ggufHub) count(n int) {
	h.mu.Lock()
	h.served += int64(n)
	h.mu.Unlock()
}

func (h *ggufHub) stats() (served int64, ranges []string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.served, append([]string(nil), h.ranges...)
}

type countingWriter struct {
	http.ResponseWriter
	h *ggufHub
}

func (c countingWriter) Write(p []byte) (int, error) {
	n, err := c.ResponseWriter.Write(p)
	c.h.count(n)
	return n, err
}

// serveGGUF starts h and returns options pointing at it, with a 4 KiB
// first header prefix so the test files' 40 KiB headers take growing
// prefixes, as a real header larger than 8 MiB would.
func serveGGUF(t *testing.T, h *ggufHub) Options {
	t.Helper()
	old := ggufHeaderPrefix
	ggufHeaderPrefix = 4 << 10
	t.Cleanup(func() { ggufHeaderPrefix = old })
	srv := httptest.NewServer(h)
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(func() {
		client.CloseIdleConnections()
		srv.Close()
	})
	return Options{Endpoint: srv.URL, CacheDir: t.TempDir(), Client: client, Token: "-"}
}

// tensorBytes is where a tensor's bytes lie in the file.
func tensorBytes(f *gguf.File, name string) span {
	ti, _ := f.Tensor(name)
	start := f.DataOffset + int64(ti.Offset)
	return span{Start: start, End: start + int64(ti.Size)}
}

// layersSpan is the bytes from layer a's first tensor to layer b's last.
func layersSpan(f *gguf.File, a, b int) span {
	return span{Start: tensorBytes(f, fmt.Sprintf("blk.%d.attn_norm.weight", a)).Start, End: tensorBytes(f, fmt.Sprintf("blk.%d.ffn_down.weight", b)).End}
}

// checkTensors opens the downloaded file with gguf.Open and compares the
// tensors a node for first..last needs with the original's; tensors far
// from them (the first and last layers) must still be holes.
func checkTensors(t *testing.T, path string, orig []byte, first, last int) {
	t.Helper()
	m, err := gguf.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	need, err := GGUFTensorsFor(m.File, first, last)
	if err != nil {
		t.Fatal(err)
	}
	if len(need) < 9*(last-first+1) {
		t.Fatalf("%d tensors selected for layers %d-%d", len(need), first, last)
	}
	for _, ti := range need {
		got, _ := m.Data(ti)
		s := tensorBytes(m.File, ti.Name)
		if !bytes.Equal(got, orig[s.Start:s.End]) {
			t.Errorf("tensor %s differs from the original", ti.Name)
		}
	}
	for _, name := range []string{"blk.0.attn_q.weight", "blk.31.ffn_up.weight"} {
		ti, _ := m.Tensor(name)
		if got, _ := m.Data(ti); first > 0 && last < 31 && bytes.Count(got, []byte{0}) != len(got) {
			t.Errorf("tensor %s was fetched for layers %d-%d", name, first, last)
		}
	}
}

func TestGGUFFetchesOnlyTheLayersTensors(t *testing.T) {
	file, hdr := writeGGUF(t, llamaKV(32), llamaTensors(32, false))
	other, _ := writeGGUF(t, llamaKV(2), llamaTensors(2, false))
	h := &ggufHub{repo: "org/llama-gguf", files: map[string][]byte{
		"llama-8b-Q4_K_M.gguf": file, "llama-8b-Q8_0.gguf": other, "README.md": []byte("hi"),
	}}
	opts := serveGGUF(t, h)
	opts.Layers = "8-15"
	path, err := DownloadGGUF(t.Context(), "org/llama-gguf:q4_k_m", opts)
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(opts.CacheDir, "org--llama-gguf", "main", "llama-8b-Q4_K_M.gguf"); path != want {
		t.Errorf("path %s, want %s", path, want)
	}
	served, ranges := h.stats()
	if frac := float64(served) / float64(len(file)); frac > 0.30 {
		t.Errorf("layers 8-15 of 32 downloaded %d of %d bytes (%.0f%%), want at most 30%%", served, len(file), 100*frac)
	}
	t.Logf("layers 8-15 of 32: %d of %d bytes (%.1f%%)", served, len(file), 100*float64(served)/float64(len(file)))
	checkTensors(t, path, file, 8, 15)
	// The header in growing prefixes, then the eight layers in one request.
	l := layersSpan(hdr, 8, 15)
	want := []string{"llama-8b-Q4_K_M.gguf bytes=0-4095", "llama-8b-Q4_K_M.gguf bytes=4096-16383",
		"llama-8b-Q4_K_M.gguf bytes=16384-65535", fmt.Sprintf("llama-8b-Q4_K_M.gguf bytes=%d-%d", l.Start, l.End-1)}
	if strings.Join(ranges, "|") != strings.Join(want, "|") {
		t.Errorf("requests\n%q\nwant\n%q", ranges, want)
	}

	// Another node's range on the same cache fetches only the layers the
	// first did not: 16-23, in one request of exactly their bytes.
	opts.Layers = "12-23"
	if _, err := DownloadGGUF(t.Context(), "org/llama-gguf:Q4_K_M", opts); err != nil {
		t.Fatal(err)
	}
	served2, ranges2 := h.stats()
	l = layersSpan(hdr, 16, 23)
	if served2-served != l.End-l.Start || len(ranges2) != len(ranges)+1 {
		t.Errorf("layers 12-23 after 8-15: %d bytes in %q, want %d in one request", served2-served, ranges2[len(ranges):], l.End-l.Start)
	}
	checkTensors(t, path, file, 8, 23)
	if _, err := DownloadGGUF(t.Context(), "org/llama-gguf:Q4_K_M", opts); err != nil {
		t.Fatal(err)
	}
	if served3, ranges3 := h.stats(); served3 != served2 || len(ranges3) != len(ranges2) {
		t.Errorf("a cached range was fetched again: %q", ranges3[len(ranges2):])
	}
}

func TestGGUFResumesInterruptedDownload(t *testing.T) {
	file, hdr := writeGGUF(t, llamaKV(32), llamaTensors(32, false))
	name := "m-Q4_K_M.gguf"
	baseline := &ggufHub{repo: "org/m", files: map[string][]byte{name: file}}
	opts := serveGGUF(t, baseline)
	opts.Layers = "8-15"
	if _, err := DownloadGGUF(t.Context(), "org/m:Q4_K_M", opts); err != nil {
		t.Fatal(err)
	}
	needed, _ := baseline.stats()

	// A connection cut mid-range is retried from the byte it stopped at.
	cut := tensorBytes(hdr, "blk.11.attn_q.weight").Start + 1000
	h := &ggufHub{repo: "org/m", files: map[string][]byte{name: file}, cutAt: map[string]int64{name: cut}}
	opts = serveGGUF(t, h)
	opts.Layers = "8-15"
	path, err := DownloadGGUF(t.Context(), "org/m:Q4_K_M", opts)
	if err != nil {
		t.Fatal(err)
	}
	checkTensors(t, path, file, 8, 15)
	served, ranges := h.stats()
	end := layersSpan(hdr, 8, 15).End
	if served != needed || !contains(ranges, fmt.Sprintf("%s bytes=%d-%d", name, cut, end-1)) {
		t.Errorf("after a cut: %d bytes served (uncut: %d), requests %q", served, needed, ranges)
	}

	// A run stopped halfway is resumed by the next from what it saved.
	// The server stalls halfway through the layers, so the cancel always
	// lands mid-download however loaded the machine is.
	mid := (layersSpan(hdr, 8, 15).Start + layersSpan(hdr, 8, 15).End) / 2
	h = &ggufHub{repo: "org/m", files: map[string][]byte{name: file}, stallAt: map[string]int64{name: mid}}
	opts = serveGGUF(t, h)
	opts.Layers = "8-15"
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	opts.Progress = func(_ string, done, total int64) {
		if total > 1<<20 && done > 0 { // the layers' first bytes are in
			cancel()
		}
	}
	if _, err := DownloadGGUF(ctx, "org/m:Q4_K_M", opts); err == nil {
		t.Fatal("a cancelled download succeeded")
	}
	var st partState
	local := filepath.Join(opts.CacheDir, "org--m", "main", name)
	if data, err := os.ReadFile(local + ".ranges.json"); err != nil || json.Unmarshal(data, &st) != nil {
		t.Fatalf("no sidecar after a stopped run: %v", err)
	}
	left := spanBytes(missing(st.Have, []span{layersSpan(hdr, 8, 15)}))
	if left == 0 || left == layersSpan(hdr, 8, 15).End-layersSpan(hdr, 8, 15).Start {
		t.Fatalf("the stopped run saved %v", st.Have)
	}
	first, _ := h.stats()
	opts.Progress = nil
	if path, err = DownloadGGUF(t.Context(), "org/m:Q4_K_M", opts); err != nil {
		t.Fatal(err)
	}
	checkTensors(t, path, file, 8, 15)
	if total, _ := h.stats(); total-first != left {
		t.Errorf("the resumed run fetched %d bytes; %d were missing", total-first, left)
	}
}

func TestGGUFWholeFileChecksum(t *testing.T) {
	file, hdr := writeGGUF(t, llamaKV(32), llamaTensors(32, false))
	name := "sub/m-Q8_0.gguf" // in a folder, as some repositories keep them
	h := &ggufHub{repo: "org/m", files: map[string][]byte{name: file}}
	opts := serveGGUF(t, h)
	path, err := DownloadGGUF(t.Context(), "org/m/"+name, opts)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(path)
	served, _ := h.stats()
	if !bytes.Equal(got, file) || served != int64(len(file)) {
		t.Fatalf("whole file: equal %v, %d bytes served for %d", bytes.Equal(got, file), served, len(file))
	}
	var st partState
	if data, err := os.ReadFile(path + ".ranges.json"); err != nil || json.Unmarshal(data, &st) != nil || !st.Verified {
		t.Errorf("sidecar %+v, %v: want verified", st, err)
	}

	// One changed byte fails the sha256 check; nothing is left to load.
	tampered := tensorBytes(hdr, "blk.20.ffn_up.weight").Start + 7
	h = &ggufHub{repo: "org/m", files: map[string][]byte{name: file}, tamper: map[string]int64{name: tampered}}
	opts = serveGGUF(t, h)
	_, err = DownloadGGUF(t.Context(), "org/m:Q8_0", opts)
	if err == nil || !strings.Contains(err.Error(), "checksum mismatch") || !strings.Contains(err.Error(), name) {
		t.Fatalf("tampered byte: %v, want a checksum mismatch naming %s", err, name)
	}
	local := filepath.Join(opts.CacheDir, "org--m", "main", "sub", "m-Q8_0.gguf")
	for _, p := range []string{local, local + ".ranges.json"} {
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%s left in the cache", p)
		}
	}

	// A tampered byte in a node's own layers passes a partial download (no
	// published checksum covers a part), but the run that completes the
	// file catches it.
	tampered = tensorBytes(hdr, "blk.9.attn_q.weight").Start + 3
	h = &ggufHub{repo: "org/m", files: map[string][]byte{name: file}, tamper: map[string]int64{name: tampered}}
	opts = serveGGUF(t, h)
	opts.Layers = "8-15"
	if _, err := DownloadGGUF(t.Context(), "org/m:Q8_0", opts); err != nil {
		t.Fatal(err)
	}
	opts.Layers = ""
	if _, err := DownloadGGUF(t.Context(), "org/m:Q8_0", opts); err == nil || !strings.Contains(err.Error(), "checksum mismatch") {
		t.Fatalf("completing a tampered partial file: %v", err)
	}
}

func TestGGUFErrors(t *testing.T) {
	file, _ := writeGGUF(t, llamaKV(4), llamaTensors(4, false))
	name := "m-Q4_K_M.gguf"
	for _, tc := range []struct {
		desc string
		ref  string
		h    *ggufHub
		want []string
	}{
		{"no such repository", "org/missing:Q4_K_M", &ggufHub{repo: "org/m"}, []string{"org/missing", "404"}},
		{"listed but not served", "org/m:Q4_K_M", &ggufHub{repo: "org/m", files: map[string][]byte{name: file}, refuse: map[string]int{name: 404}}, []string{name, "404"}},
		{"range not satisfiable", "org/m:Q4_K_M", &ggufHub{repo: "org/m", files: map[string][]byte{name: file}, refuse: map[string]int{name: 416}}, []string{name, "416", "refused bytes 0-4095"}},
		{"size unlike the listing's", "org/m:Q4_K_M", &ggufHub{repo: "org/m", files: map[string][]byte{name: file}, listed: map[string]int64{name: int64(len(file) + 64)}}, []string{name, "listing says"}},
		{"no such file", "org/m/other.gguf", &ggufHub{repo: "org/m", files: map[string][]byte{name: file}}, []string{"no file other.gguf", "Q4_K_M (m-Q4_K_M.gguf)"}},
		{"not a GGUF", "org/m:Q4_K_M", &ggufHub{repo: "org/m", files: map[string][]byte{name: bytes.Repeat([]byte("x"), 5000)}}, []string{name, "not a GGUF file"}},
	} {
		_, err := DownloadGGUF(t.Context(), tc.ref, serveGGUF(t, tc.h))
		t.Logf("%s: %v", tc.desc, err)
		for _, w := range tc.want {
			if err == nil || !strings.Contains(err.Error(), w) {
				t.Errorf("%s: error %v, want one containing %q", tc.desc, err, w)
			}
		}
	}
	// A GGUF-only repository named as org/name says how to pick a file.
	h := &ggufHub{repo: "org/m", files: map[string][]byte{name: file}}
	if _, err := Download(t.Context(), "org/m", serveGGUF(t, h)); err == nil || !strings.Contains(err.Error(), "org/m:TAG") || !strings.Contains(err.Error(), "Q4_K_M") {
		t.Errorf("GGUF repository as org/name: %v", err)
	}
}

func TestGGUFSplitFile(t *testing.T) {
	// Three parts as gguf-split writes them: the metadata in the first,
	// each part a GGUF of its own tensors.
	all := llamaTensors(32, false)
	cuts := [][2]int{{0, 1 + 11*9}, {1 + 11*9, 1 + 22*9}, {1 + 22*9, len(all)}}
	files := map[string][]byte{}
	var orig [][]byte
	var size int64
	for i, c := range cuts {
		kv := []gguf.KV{{Key: "split.no", Value: gguf.Uint16(uint16(i))}, {Key: "split.count", Value: gguf.Uint16(3)}}
		if i == 0 {
			kv = append(llamaKV(32), kv...)
		}
		data, _ := writeGGUF(t, kv, all[c[0]:c[1]])
		files[fmt.Sprintf("m-Q4_K_M-%05d-of-00003.gguf", i+1)] = data
		orig = append(orig, data)
		size += int64(len(data))
	}
	h := &ggufHub{repo: "org/m", files: files}
	opts := serveGGUF(t, h)
	opts.Layers = "8-15"
	path, err := DownloadGGUF(t.Context(), "org/m:Q4_K_M", opts)
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(path) != "m-Q4_K_M-00001-of-00003.gguf" {
		t.Errorf("path %s, want the first part", path)
	}
	if served, _ := h.stats(); float64(served) > 0.30*float64(size) {
		t.Errorf("layers 8-15 of a split file downloaded %d of %d bytes", served, size)
	}
	var got int
	for i := range cuts {
		m, err := gguf.Open(filepath.Join(filepath.Dir(path), fmt.Sprintf("m-Q4_K_M-%05d-of-00003.gguf", i+1)))
		if err != nil {
			t.Fatal(err)
		}
		for _, ti := range m.Tensors {
			if GGUFNeeds(ti.Name, 8, 15, 32, true) {
				data, _ := m.Data(ti)
				s := tensorBytes(m.File, ti.Name)
				if !bytes.Equal(data, orig[i][s.Start:s.End]) {
					t.Errorf("part %d: tensor %s differs", i+1, ti.Name)
				}
				got++
			}
		}
		m.Close()
	}
	if got != 8*9 {
		t.Errorf("%d tensors for layers 8-15 across the parts, want 72", got)
	}
}

func TestGGUFTagResolution(t *testing.T) {
	tree := map[string]entry{}
	for _, p := range []string{
		"Llama-3-8B-Q4_K_M.gguf", "Llama-3-8B-Q8_0.gguf", "Llama-3-8B-BF16.gguf",
		"Llama-3-8B-F16-00002-of-00002.gguf", "Llama-3-8B-F16-00001-of-00002.gguf",
		"mmproj-Llama-3-8B-F16.gguf", "sub/Llama-3-8B-Q4_K_S.gguf",
		"a-IQ4_XS.gguf", "b-IQ4_XS.gguf",
		"Llama-Q5_K_M-00001-of-00003.gguf", "Llama-Q5_K_M-00003-of-00003.gguf",
		"README.md", "config.json",
	} {
		tree[p] = entry{Type: "file", Path: p, Size: 1}
	}
	for _, tc := range []struct {
		ref  GGUFRef
		want string // the paths picked, or an error's pieces after "error:"
	}{
		{GGUFRef{Tag: "q4_k_m"}, "Llama-3-8B-Q4_K_M.gguf"},
		{GGUFRef{Tag: "F16"}, "Llama-3-8B-F16-00001-of-00002.gguf Llama-3-8B-F16-00002-of-00002.gguf"},
		{GGUFRef{Tag: "BF16"}, "Llama-3-8B-BF16.gguf"},
		{GGUFRef{Tag: "Q4_K_S"}, "sub/Llama-3-8B-Q4_K_S.gguf"},
		{GGUFRef{File: "Llama-3-8B-F16-00002-of-00002.gguf"}, "Llama-3-8B-F16-00001-of-00002.gguf Llama-3-8B-F16-00002-of-00002.gguf"},
		{GGUFRef{File: "mmproj-Llama-3-8B-F16.gguf"}, "mmproj-Llama-3-8B-F16.gguf"},
		{GGUFRef{Tag: "Q4_K"}, "error: no GGUF file tagged Q4_K|Q4_K_M (Llama-3-8B-Q4_K_M.gguf)|Q8_0 (Llama-3-8B-Q8_0.gguf)|Q4_K_S (sub/"},
		{GGUFRef{Tag: "IQ4_XS"}, "error: matches several|a-IQ4_XS.gguf|b-IQ4_XS.gguf|org/m/FILE"},
		{GGUFRef{Tag: "Q5_K_M"}, "error: incomplete|Llama-Q5_K_M-00001-of-00003.gguf, Llama-Q5_K_M-00003-of-00003.gguf"},
		{GGUFRef{File: "nope.gguf"}, "error: no file nope.gguf"},
	} {
		tc.ref.Repo = "org/m"
		parts, err := pickGGUF(tree, tc.ref)
		t.Logf("%s: %v", tc.ref, err)
		if want, isErr := strings.CutPrefix(tc.want, "error: "); isErr {
			for _, w := range strings.Split(want, "|") {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Errorf("%s: error %v, want one containing %q", tc.ref, err, w)
				}
			}
			if err != nil && strings.Contains(err.Error(), "mmproj") && tc.ref.Tag != "" {
				t.Errorf("%s: a projector offered as a model: %v", tc.ref, err)
			}
			continue
		}
		var got []string
		for _, e := range parts {
			got = append(got, e.Path)
		}
		if err != nil || strings.Join(got, " ") != tc.want {
			t.Errorf("%s: %q, %v; want %q", tc.ref, got, err, tc.want)
		}
	}
}

func TestGGUFTensorsFor(t *testing.T) {
	names := func(ts []gguf.TensorInfo) string {
		var s []string
		for _, t := range ts {
			s = append(s, t.Name)
		}
		return strings.Join(s, " ")
	}
	tensors := func(tied bool) []gguf.WriteTensor {
		ts := []gguf.WriteTensor{{Name: "token_embd.weight", Dims: []uint64{32, 8}, Type: gguf.F32}, {Name: "rope_freqs.weight", Dims: []uint64{4}, Type: gguf.F32}}
		for i := range 12 {
			ts = append(ts, gguf.WriteTensor{Name: fmt.Sprintf("blk.%d.attn_q.weight", i), Dims: []uint64{32, 32}, Type: gguf.F32})
		}
		ts = append(ts, gguf.WriteTensor{Name: "output_norm.weight", Dims: []uint64{32}, Type: gguf.F32})
		if !tied {
			ts = append(ts, gguf.WriteTensor{Name: "output.weight", Dims: []uint64{32, 8}, Type: gguf.F32})
		}
		return ts
	}
	kv := []gguf.KV{{Key: "general.architecture", Value: gguf.String("qwen2")}, {Key: "qwen2.block_count", Value: gguf.Uint32(12)}}
	_, f := writeGGUF(t, kv, tensors(false))
	_, tied := writeGGUF(t, kv, tensors(true))
	for _, tc := range []struct {
		f           *gguf.File
		first, last int
		want        string
	}{
		{f, 0, 1, "token_embd.weight rope_freqs.weight blk.0.attn_q.weight blk.1.attn_q.weight"},
		{f, 1, 1, "rope_freqs.weight blk.1.attn_q.weight"}, // not blk.10 or blk.11
		{f, 10, 11, "rope_freqs.weight blk.10.attn_q.weight blk.11.attn_q.weight output_norm.weight output.weight"},
		{tied, 10, 11, "token_embd.weight rope_freqs.weight blk.10.attn_q.weight blk.11.attn_q.weight output_norm.weight"},
		{tied, 4, 5, "rope_freqs.weight blk.4.attn_q.weight blk.5.attn_q.weight"},
	} {
		got, err := GGUFTensorsFor(tc.f, tc.first, tc.last)
		if err != nil || names(got) != tc.want {
			t.Errorf("layers %d-%d: %q, %v; want %q", tc.first, tc.last, names(got), err, tc.want)
		}
	}
	if _, err := GGUFTensorsFor(f, 5, 12); err == nil {
		t.Error("layers past the model were accepted")
	}
	_, noArch := writeGGUF(t, nil, tensors(false))
	if _, err := GGUFTensorsFor(noArch, 0, 1); err == nil || !strings.Contains(err.Error(), "general.architecture") {
		t.Errorf("no architecture: %v", err)
	}
}

func TestParseGGUFRefAndResolve(t *testing.T) {
	for s, want := range map[string]string{
		"org/repo:Q4_K_M":             "org/repo Q4_K_M ",
		"bartowski/Llama-3.2-1B:q8_0": "bartowski/Llama-3.2-1B q8_0 ",
		"org/repo/model.gguf":         "org/repo  model.gguf",
		"org/repo/sub/Model.GGUF":     "org/repo  sub/Model.GGUF",
		"org/repo":                    "",
		"org/repo:":                   "",
		"org/repo:a/b":                "",
		"org/repo/model.safetensors":  "",
		"org/repo/../x.gguf":          "",
		"org/repo//x.gguf":            "",
		"./org/x.gguf":                "",
		"/models/org/x.gguf":          "",
		"model.gguf":                  "",
		"models/model.gguf":           "",
	} {
		r, ok := ParseGGUFRef(s)
		got := ""
		if ok {
			got = r.Repo + " " + r.Tag + " " + r.File
		}
		if got != want {
			t.Errorf("ParseGGUFRef(%q) = %q, want %q", s, got, want)
		}
	}
	// A local .gguf path is never taken for a hub reference, even when it
	// could be one; the endpoint here answers nothing.
	dir := t.TempDir()
	t.Chdir(dir)
	os.MkdirAll("org/repo", 0o755)
	os.WriteFile("org/repo/model.gguf", []byte("GGUF"), 0o644)
	opts := Options{Endpoint: "http://127.0.0.1:1", CacheDir: t.TempDir(), Attempts: 1}
	for _, p := range []string{"org/repo/model.gguf", filepath.Join(dir, "org/repo/model.gguf")} {
		if got, err := Resolve(t.Context(), p, opts); err != nil || got != p {
			t.Errorf("Resolve(%q) = %q, %v", p, got, err)
		}
	}
}
