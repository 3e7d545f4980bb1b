package daemon

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"meshgpu/identity"
	"meshgpu/internal/testenv"
	"meshgpu/model"
	"meshgpu/native"
	"meshgpu/openai"
	"meshgpu/tracker"
	"meshgpu/wire"
)

// For a checkpoint whose layers are alike (gocoder-6m, bf16) the real
// sizes are the config's estimate, so registrations are unchanged.
func TestFootprintOfCheckpointMatchesTheEstimate(t *testing.T) {
	dir := testenv.GoCoder(t)
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	ck, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	got, err := FootprintOfCheckpoint(ck, cfg, "cpu", 512, 4)
	if err != nil {
		t.Fatal(err)
	}
	if want := FootprintOf(cfg, "cpu", 512, 4); !reflect.DeepEqual(got, want) {
		t.Fatalf("from tensor infos %+v, estimated %+v", got, want)
	}
}

// A node computes its variant at start-up and registers it (and assigns
// with it); the tracker's /nodes and /v1/models and the node's own
// /v1/models name it.
func TestNodeRegistersItsVariant(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	ck, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	mv, err := model.VariantOf(ck, cfg, "")
	ck.Close()
	if err != nil {
		t.Fatal(err)
	}
	want := wire.Variant{Label: "bf16", Fingerprint: mv.Fingerprint}

	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	tr := tracker.NewServer(tracker.Config{Endpoints: tracker.AddrPolicy{AllowLoopback: true}, Logger: log})
	ts := httptest.NewServer(tr.Handler())
	defer ts.Close()
	id, err := identity.LoadOrCreate(filepath.Join(t.TempDir(), "k"))
	if err != nil {
		t.Fatal(err)
	}
	fp := FootprintOf(cfg, "cpu", 64, 2)
	n, err := Start(context.Background(), Config{ModelDir: dir, Backend: be, Identity: id, Auto: true,
		MemoryBudget: 10 * (fp.BytesPerLayer + fp.KVReservePerLayer + fp.EmbedBytes + fp.HeadBytes),
		TrackerURL:   ts.URL, MaxSessions: 2, MaxContext: 64, Logger: log, HeartbeatInterval: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	if n.Variant() != want {
		t.Fatalf("node variant %+v, want %+v", n.Variant(), want)
	}
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{}}
	defer hc.Transport.(*http.Transport).CloseIdleConnections()
	get := func(url string, out any) {
		t.Helper()
		resp, err := hc.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
			t.Fatal(err)
		}
	}
	var nodes struct{ Nodes []tracker.PublicNode }
	get(ts.URL+"/nodes", &nodes)
	if len(nodes.Nodes) != 1 || nodes.Nodes[0].Variant != want || nodes.Nodes[0].Layers != [2]int{0, 5} {
		t.Fatalf("tracker /nodes: %+v", nodes)
	}
	for _, url := range []string{ts.URL, n.URL()} {
		var list openai.ModelList
		get(url+"/v1/models", &list)
		if len(list.Data) != 1 || list.Data[0].Meshgpu == nil || !reflect.DeepEqual(list.Data[0].Meshgpu.Variants, []wire.Variant{want}) {
			t.Fatalf("%s/v1/models: %+v", url, list)
		}
	}
}
