package e2e

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"meshgpu/daemon"
	"meshgpu/engine"
	"meshgpu/internal/testenv"
	"meshgpu/model"
	"meshgpu/model/chat"
	"meshgpu/openai"
	"meshgpu/tracker"
	"meshgpu/wire"
)

// f32Copy writes dir's model with every bf16 tensor widened to f32 (exact:
// the same numbers, other bytes, so another variant) into a directory of
// the same base name (the model's name in the mesh), with the other files
// copied.
func f32Copy(t *testing.T, dir string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), filepath.Base(dir))
	if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if !e.Type().IsRegular() || strings.HasSuffix(e.Name(), ".safetensors") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(out, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ck, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	var ts []model.Tensor
	for _, name := range ck.Names() {
		tt, err := ck.Tensor(name)
		if err != nil {
			t.Fatal(err)
		}
		if tt.DType == model.BF16 {
			wide := make([]byte, 2*len(tt.Data))
			for i := 0; i < len(tt.Data); i += 2 {
				// bf16 is the top half of an f32
				binary.LittleEndian.PutUint32(wide[2*i:], uint32(binary.LittleEndian.Uint16(tt.Data[i:]))<<16)
			}
			tt = model.Tensor{Name: tt.Name, DType: model.F32, Shape: tt.Shape, Data: wide}
		}
		ts = append(ts, tt)
	}
	if err := model.WriteSafetensorsFile(filepath.Join(out, "model.safetensors"), ts, nil); err != nil {
		t.Fatal(err)
	}
	return out
}

// variantOf is what a node of dir registers.
func variantOf(t *testing.T, dir string) wire.Variant {
	t.Helper()
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	ck, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	v, err := model.VariantOf(ck, cfg, "")
	if err != nil {
		t.Fatal(err)
	}
	return wire.Variant{Label: v.Label, Fingerprint: v.Fingerprint}
}

// nodeStats is the part of a node's GET /stats this test reads.
type nodeStats struct {
	HopsOK   int64 `json:"hops_ok"`
	Requests int64 `json:"requests"`
}

// The GGUF issue's acceptance, with real processes: two variants of one
// model (gocoder-6m as bf16, and the same weights stored as f32) are
// never in one route.
//
//  1. A bf16 head (0-2) and an f32 tail (3-5) together hold every layer,
//     but only by mixing weights: the tracker serves nobody (503, no model
//     in /v1/models, /map not covered), where a variant-blind tracker
//     would chain them.
//  2. An f32 and a bf16 `meshgpu run --auto` join, with budgets from their
//     own files' real sizes (f32 layers take twice the bytes) that fit
//     three layers: each gets its own variant's gap (f32 0-2, bf16 3-5),
//     though the mesh as a whole already holds every layer.
//  3. Each chat through the tracker names its variant (X-Meshnet-Variant),
//     equals one in-process model of that variant's files, and was served
//     by exactly that variant's head and tail (every node's /stats before
//     and after); GET /route for many seeds gives routes of one variant;
//     /map, /v1/models, /nodes and /api/mesh show both variants.
func TestVariantsNeverShareARoute(t *testing.T) {
	bfDir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	f32Dir := f32Copy(t, bfDir)
	bf, f32 := variantOf(t, bfDir), variantOf(t, f32Dir)
	if bf.Label != "bf16" || f32.Label != "f32" || bf.Same(f32) {
		t.Fatalf("variants %v and %v: want bf16 and f32 with different fingerprints", bf, f32)
	}
	const maxTokens = 24
	msgs := []chat.Message{{Role: "user", Content: "Write a Go function that sums a slice of ints."}}
	ref := map[string]*engine.Result{bf.Fingerprint: wholeModelChat(t, bfDir, msgs, maxTokens), f32.Fingerprint: wholeModelChat(t, f32Dir, msgs, maxTokens)}
	dirOf := map[string]string{bf.Fingerprint: bfDir, f32.Fingerprint: f32Dir}

	_, trackerAddr := startProc(t, "tracker", addrLine, "tracker", "--listen", "127.0.0.1:0", "--token-timeout", "5s",
		"--audit-rate", "0", "--audit-probation=false")
	trackerURL := "http://" + trackerAddr
	const maxCtx, maxSessions = 256, 2
	type meshNode struct {
		name, url, layers string
		variant           wire.Variant
	}
	var nodes []meshNode
	start := func(name string, v wire.Variant, extra ...string) meshNode {
		t.Helper()
		args := append([]string{"run", "--model", dirOf[v.Fingerprint], "--backend", "cpu", "--threads", "1",
			"--key", filepath.Join(t.TempDir(), "node.key"), "--listen", "127.0.0.1:0", "--tracker", trackerURL,
			"--hop-dtype", "f32", "--hop-timeout", "5s", "--max-sessions", fmt.Sprint(maxSessions),
			"--max-context", fmt.Sprint(maxCtx), "--heartbeat-interval", "500ms"}, extra...)
		p, layers := startProc(t, name, nodeLine, args...)
		n := meshNode{name: name, layers: layers, variant: v,
			url: "http://" + regexp.MustCompile(`msg="listening on (\S+)"`).FindStringSubmatch(p.log())[1]}
		nodes = append(nodes, n)
		return n
	}
	hc := newHTTPClient(t)
	waitNodes := func(n int) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for {
			var v struct{ Nodes []tracker.PublicNode }
			getJSON(t, hc, trackerURL+"/nodes", &v)
			if len(v.Nodes) == n {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the tracker lists %d nodes, want %d", len(v.Nodes), n)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}

	// 1. Half of each variant: no route.
	start("bf16 head", bf, "--layers", "0-2")
	start("f32 tail", f32, "--layers", "3-5")
	waitNodes(2)
	body := map[string]any{"model": "gocoder-6m", "messages": msgs, "max_tokens": maxTokens, "temperature": 0, "ignore_eos": true, "stream": true}
	if code, msg := postStatus(t, hc, trackerURL+"/v1/chat/completions", body); code != 503 {
		t.Fatalf("chat over a bf16 head and an f32 tail: %d %s; want 503 (the only chain mixes variants)", code, msg)
	}
	var models openai.ModelList
	getJSON(t, hc, trackerURL+"/v1/models", &models)
	var am tracker.AvailabilityMap
	getJSON(t, hc, trackerURL+"/map", &am)
	if len(models.Data) != 0 || am.Covered || len(am.Variants) != 2 {
		t.Fatalf("with half of each variant: /v1/models %+v, /map covered %v with %d variants", models, am.Covered, len(am.Variants))
	}

	// 2. --auto joiners fill their own variant's gap, sized by their files.
	budget := func(dir string) int64 {
		cfg, err := model.LoadConfig(dir)
		if err != nil {
			t.Fatal(err)
		}
		ck, err := model.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer ck.Close()
		fp, err := daemon.FootprintOfCheckpoint(ck, cfg, "cpu", maxCtx, maxSessions)
		if err != nil {
			t.Fatal(err)
		}
		layer := fp.BytesPerLayer + fp.KVReservePerLayer
		return 3*layer + max(fp.EmbedBytes, fp.HeadBytes) + layer/2 // three layers, not four
	}
	if got := start("f32 head", f32, "--auto", "--memory-budget", fmt.Sprint(budget(f32Dir))); got.layers != "0-2" {
		t.Fatalf("the f32 joiner got %s, want f32's gap 0-2", got.layers)
	}
	if got := start("bf16 tail", bf, "--auto", "--memory-budget", fmt.Sprint(budget(bfDir))); got.layers != "3-5" {
		t.Fatalf("the bf16 joiner got %s, want bf16's gap 3-5", got.layers)
	}
	waitNodes(4)

	// 3. Every chat runs on one variant's nodes, and answers as that
	// variant's files do.
	stats := func() []nodeStats {
		out := make([]nodeStats, len(nodes))
		for i, n := range nodes {
			getJSON(t, hc, n.url+"/stats", &out[i])
		}
		return out
	}
	served := map[string]int{}
	for i := range 6 {
		before := stats()
		resp := postResp(t, hc, trackerURL+"/v1/chat/completions", body)
		got := readSSE(t, resp.Body)
		resp.Body.Close()
		fp := resp.Header.Get(wire.HeaderVariant)
		want, ok := ref[fp]
		if !ok {
			t.Fatalf("chat %d: variant header %q names neither variant", i, fp)
		}
		if !got.done || got.err != "" || got.text != want.Text {
			t.Fatalf("chat %d on %s (done %v, error %q):\n%q\nthat variant's in-process model:\n%q", i, resp.Header.Get(wire.HeaderVariantLabel), got.done, got.err, got.text, want.Text)
		}
		after := stats()
		for j, n := range nodes {
			dReq, dHops := after[j].Requests-before[j].Requests, after[j].HopsOK-before[j].HopsOK
			ofRoute := n.variant.Fingerprint == fp
			switch {
			case !ofRoute && (dReq != 0 || dHops != 0):
				t.Fatalf("chat %d on %s: the %s (variant %v) served %d requests and %d hops", i, fp[:8], n.name, n.variant, dReq, dHops)
			case ofRoute && n.layers == "0-2" && dReq != 1:
				t.Fatalf("chat %d: the %s served %d requests, want 1", i, n.name, dReq)
			case ofRoute && n.layers == "3-5" && dHops == 0:
				t.Fatalf("chat %d: the %s served no hop", i, n.name)
			}
		}
		served[resp.Header.Get(wire.HeaderVariantLabel)]++
	}

	variantOfPeer := map[string]wire.Variant{}
	var pub struct{ Nodes []tracker.PublicNode }
	getJSON(t, hc, trackerURL+"/nodes", &pub)
	for _, n := range pub.Nodes {
		variantOfPeer[n.PeerID] = n.Variant
	}
	if len(variantOfPeer) != 4 {
		t.Fatalf("/nodes: %+v", pub)
	}
	routes := map[string]int{}
	for seed := range 40 {
		var rt struct {
			Hops    []wire.Hop
			Variant wire.Variant
		}
		getJSON(t, hc, fmt.Sprintf("%s/route?seed=%d", trackerURL, seed), &rt)
		for _, h := range rt.Hops {
			if v := variantOfPeer[h.PeerID]; !v.Same(rt.Variant) || v.IsZero() {
				t.Fatalf("seed %d: hop %s is %v in a route of %v", seed, h.PeerID, v, rt.Variant)
			}
		}
		routes[rt.Variant.Label]++
	}
	getJSON(t, hc, trackerURL+"/v1/models", &models)
	getJSON(t, hc, trackerURL+"/map", &am)
	var mv tracker.MeshView
	getJSON(t, hc, trackerURL+"/api/mesh", &mv)
	if len(models.Data) != 1 || models.Data[0].Meshgpu == nil || len(models.Data[0].Meshgpu.Variants) != 2 ||
		!am.Covered || len(am.Variants) != 2 || !am.Variants[0].Covered || !am.Variants[1].Covered || len(mv.Nodes) != 4 || mv.Nodes[0].Variant.IsZero() {
		t.Fatalf("/v1/models %+v, /map %+v, /api/mesh nodes %+v", models, am, mv.Nodes)
	}
	t.Logf("chats served by variant %v; GET /route by variant %v; fingerprints bf16 %s, f32 %s", served, routes, bf.Fingerprint[:12], f32.Fingerprint[:12])
}

// postStatus sends body and returns the status and the start of the answer.
func postStatus(t *testing.T, hc *http.Client, url string, body any) (int, string) {
	t.Helper()
	resp := postResp(t, hc, url, body)
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 300))
	return resp.StatusCode, string(b)
}

func postResp(t *testing.T, hc *http.Client, url string, body any) *http.Response {
	t.Helper()
	b, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := hc.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	return resp
}
