package node

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/openai"
	"meshgpu/wire"
)

// sampledOn is how many tokens s's backend sampled (sched.Work.Sample).
func sampledOn(s *Server) int64 {
	sc, err := s.scheduler()
	if err != nil || sc == nil {
		return 0
	}
	return sc.Stats().Sampled
}

// streamEvents streams a completion and returns each event's choices and
// meshgpu extension (token id, logprob, top alternatives by id), the parts
// a client sees that do not vary between runs.
func streamEvents(c *http.Client, url string, body map[string]any) ([]string, error) {
	body["stream"] = true
	resp, err := postJSON(context.Background(), c, url+"/v1/completions", body)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("HTTP %d", resp.StatusCode)
	}
	sr := openai.NewSSEReader(resp.Body, 1<<20)
	var out []string
	for {
		ev, err := sr.Next()
		if err != nil {
			return out, fmt.Errorf("stream ended without [DONE]: %v", err)
		}
		if ev == openai.SSEDone {
			return out, nil
		}
		var ch struct {
			Choices json.RawMessage `json:"choices"`
			Meshgpu json.RawMessage `json:"meshgpu"`
			Error   *wire.Error     `json:"error"`
		}
		if err := json.Unmarshal([]byte(ev), &ch); err != nil {
			return out, err
		}
		if ch.Error != nil {
			return out, ch.Error
		}
		out = append(out, string(ch.Choices)+" "+string(ch.Meshgpu))
	}
}

// TestBackendSamplingMatchesHost: a tail behind a head (bf16 hops) and a
// node holding every layer sample in the backend (sched.Work.Sample), and
// every event a client sees (ids, text, logprob, top logprobs) equals that
// of the same nodes sampling in Go from the logits (SampleOnHost), for
// several streams at once, greedy and seeded temperature with penalties,
// prompts longer than the prefill chunk. The backend did sample (its
// counter), and not on the host nodes. A response format and a speculating
// head's verify passes keep the logits path (same events, fewer tokens
// sampled in the backend than generated).
func TestBackendSamplingMatchesHost(t *testing.T) {
	testenv.CheckGoroutines(t)
	dir, be, load := gocoderLoader(t)
	golden := loadGolden(t, dir)
	headModel, tailModel, full := load(0, 2), load(3, 5), load(0, -1)
	const chunk = 4
	node := func(s *Server) (*Server, string) {
		s.Backend, s.PrefillChunk = be, chunk
		return s, startNode(t, s)
	}
	tailEnds, tailEndsURL := node(&Server{Model: tailModel, PeerID: "tail-ends"})
	tailHost, tailHostURL := node(&Server{Model: tailModel, PeerID: "tail-host", SampleOnHost: true})
	_, headEnds := node(&Server{Model: headModel, PeerID: "head-ends", Route: []wire.Hop{{Endpoint: tailEndsURL, StartLayer: 3, EndLayer: 5, PeerID: "tail-ends"}}})
	_, headHost := node(&Server{Model: headModel, PeerID: "head-host", Route: []wire.Hop{{Endpoint: tailHostURL, StartLayer: 3, EndLayer: 5, PeerID: "tail-host"}}})
	_, specEnds := node(&Server{Model: headModel, PeerID: "spec-ends", Speculate: wire.SpeculateNGram,
		Route: []wire.Hop{{Endpoint: tailEndsURL, StartLayer: 3, EndLayer: 5, PeerID: "tail-ends"}}})
	localEnds, localEndsURL := node(&Server{Model: full, PeerID: "local-ends"})
	localHost, localHostURL := node(&Server{Model: full, PeerID: "local-host", SampleOnHost: true})
	c := &http.Client{Timeout: 120 * time.Second}
	defer c.CloseIdleConnections()

	const n = 10
	bodies := []map[string]any{}
	for i, g := range golden {
		if len(g.PromptIDs) <= chunk {
			t.Fatalf("golden prompt %d has %d tokens, not more than the chunk of %d", i, len(g.PromptIDs), chunk)
		}
		bodies = append(bodies,
			map[string]any{"prompt": g.PromptIDs, "max_tokens": n, "temperature": 0, "ignore_eos": true, "logprobs": 3},
			map[string]any{"prompt": g.PromptIDs, "max_tokens": n, "temperature": 0.9, "seed": 7 + i, "top_p": 0.9, "top_k": 50,
				"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.3, "logprobs": 5, "ignore_eos": true},
			map[string]any{"prompt": g.PromptIDs, "max_tokens": n, "temperature": 1.1, "seed": 3 + i, "ignore_eos": true})
	}
	// all bodies at once on url
	run := func(url string) [][]string {
		got := make([][]string, len(bodies))
		errs := make([]error, len(bodies))
		var wg sync.WaitGroup
		for i, b := range bodies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				got[i], errs[i] = streamEvents(c, url, clone(b))
			}()
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Fatalf("%s, request %d: %v", url, i, err)
			}
		}
		return got
	}
	tokens := int64(len(bodies) * n)
	for _, pair := range []struct {
		name             string
		ends, host       string
		endsNode, hostNd *Server
	}{{"split mesh", headEnds, headHost, tailEnds, tailHost}, {"single node", localEndsURL, localHostURL, localEnds, localHost}} {
		before := sampledOn(pair.endsNode)
		got, want := run(pair.ends), run(pair.host)
		for i := range bodies {
			if !slices.Equal(got[i], want[i]) {
				t.Errorf("%s, request %d (%v): backend sampling\n%v\nGo sampling\n%v", pair.name, i, bodies[i], got[i], want[i])
			}
		}
		if d := sampledOn(pair.endsNode) - before; d != tokens {
			t.Errorf("%s: the backend sampled %d tokens, want all %d", pair.name, d, tokens)
		}
		if d := sampledOn(pair.hostNd); d != 0 {
			t.Errorf("%s: the node sampling on the host sampled %d tokens in the backend", pair.name, d)
		}
	}

	// A response format's mask is applied in Go: the logits path.
	before := sampledOn(localEnds)
	jsonBody := map[string]any{"prompt": golden[0].PromptIDs, "max_tokens": n, "temperature": 0, "logprobs": 2,
		"response_format": map[string]any{"type": "json_object"}}
	got, err := streamEvents(c, localEndsURL, clone(jsonBody))
	if err != nil {
		t.Fatal(err)
	}
	want, err := streamEvents(c, localHostURL, clone(jsonBody))
	if err != nil || !slices.Equal(got, want) {
		t.Errorf("response_format: %v; backend node\n%v\nhost node\n%v", err, got, want)
	}
	if d := sampledOn(localEnds) - before; d != 0 {
		t.Errorf("a response_format request sampled %d tokens in the backend", d)
	}

	// Verify passes: the speculating head's text equals plain decoding's,
	// and fewer tokens than it generated were sampled in the backend.
	greedy := map[string]any{"prompt": golden[1].PromptIDs, "max_tokens": 24, "temperature": 0, "ignore_eos": true}
	before = sampledOn(tailEnds)
	got, err = streamEvents(c, specEnds, clone(greedy))
	if err != nil {
		t.Fatal(err)
	}
	spec := sampledOn(tailEnds) - before
	want, err = streamEvents(c, headHost, clone(greedy))
	if err != nil {
		t.Fatal(err)
	}
	if ids(t, got) != ids(t, want) {
		t.Errorf("speculating head: %s, plain decoding %s", ids(t, got), ids(t, want))
	}
	if spec >= 24 {
		t.Errorf("the tail sampled %d of the speculating head's 24 tokens in the backend: no verify pass took the logits path", spec)
	}
	waitSessions(t, c, tailEndsURL, tailHostURL, localEndsURL, localHostURL)
}

func clone(m map[string]any) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// ids is the token ids of a stream's events, in order.
func ids(t *testing.T, events []string) string {
	t.Helper()
	var out []int32
	for _, ev := range events {
		var m struct{ Token *int32 }
		if i := len(ev) - 1; i >= 0 {
			if err := json.Unmarshal([]byte(ev[slices.Index([]byte(ev), ' ')+1:]), &m); err == nil && m.Token != nil {
				out = append(out, *m.Token)
			}
		}
	}
	return fmt.Sprint(out)
}

// nanHeadStack is a real CPU stack of one layer and the head, whose LM head
// makes token 3's logit NaN for any input (a model that blew up).
func nanHeadStack(t *testing.T, be native.Backend) native.Stack {
	cfg := native.StackConfig{Hidden: 32, Intermediate: 48, Heads: 2, KVHeads: 1, HeadDim: 16, Vocab: 20, NumLayers: 1,
		First: 0, Last: 0, HasHead: true, MaxContext: 64, RMSEps: 1e-5, Rope: native.Rope{Theta: 10000}}
	st, err := be.NewStack(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	tensor := func(kind native.TensorKind, layer int, v float32, shape ...int) native.Tensor {
		n := 1
		for _, d := range shape {
			n *= d
		}
		data := make([]byte, 2*n)
		for i := 0; i < n; i++ {
			put(data, native.BF16, i, v*float32(1+i%5))
		}
		if kind == native.LMHead {
			binary.LittleEndian.PutUint16(data[2*3*cfg.Hidden:], 0x7fc0) // NaN
		}
		return native.Tensor{Kind: kind, Layer: layer, DType: native.BF16, Shape: shape, Data: data}
	}
	h, q, kv, m := cfg.Hidden, cfg.Heads*cfg.HeadDim, cfg.KVHeads*cfg.HeadDim, cfg.Intermediate
	for _, ts := range []native.Tensor{tensor(native.AttnNorm, 0, 1, h), tensor(native.WQ, 0, 0.01, q, h), tensor(native.WK, 0, 0.01, kv, h),
		tensor(native.WV, 0, 0.01, kv, h), tensor(native.WO, 0, 0.01, h, q), tensor(native.MLPNorm, 0, 1, h),
		tensor(native.WGate, 0, 0.01, m, h), tensor(native.WUp, 0, 0.01, m, h), tensor(native.WDown, 0, 0.01, h, m),
		tensor(native.FinalNorm, -1, 1, h), tensor(native.LMHead, -1, 0.01, cfg.Vocab, h)} {
		if err := st.SetTensor(ts); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.Ready(); err != nil {
		t.Fatal(err)
	}
	return st
}

// TestBackendSamplingRefusesNaN: a tail whose model gives NaN logits
// answers 500 non_finite_logits, never a token, whether the backend
// samples (its refusal, StatusNonFinite) or Go does.
func TestBackendSamplingRefusesNaN(t *testing.T) {
	testenv.CheckGoroutines(t)
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	st := nanHeadStack(t, be)
	for _, onHost := range []bool{false, true} {
		s := &Server{StackForTesting: st, PeerID: "nan-tail", SampleOnHost: onHost}
		url := startNode(t, s)
		code, h, b := hopReq{session: "nan", n: 2, hidden: 32, dtype: native.F32, start: 0, end: 0}.send(t, http.DefaultClient, url)
		ae := decodeError(t, code, h, b)
		if code != http.StatusInternalServerError || ae.Type != "non_finite_logits" {
			t.Fatalf("sample on host %v: %d %s, want 500 non_finite_logits", onHost, code, b)
		}
		sc, _ := s.scheduler()
		if stats := sc.Stats(); (stats.SampleCalls > 0) == onHost || stats.Sampled != 0 {
			t.Errorf("sample on host %v: %+v, want sampling calls only in the backend's case and no token", onHost, stats)
		}
	}
}
