package node

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
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
	// speculating heads (a tree of drafts runs in one call: the default chunk)
	tailSpec := &Server{Model: tailModel, Backend: be, PeerID: "tail-spec"}
	tailSpecURL := startNode(t, tailSpec)
	specEnds := map[wire.SpeculateMode]string{}
	for _, m := range []wire.SpeculateMode{wire.SpeculateNGram, wire.SpeculateNGramTree} {
		specEnds[m] = startNode(t, &Server{Model: headModel, Backend: be, PeerID: "spec-" + string(m), Speculate: m,
			Route: []wire.Hop{{Endpoint: tailSpecURL, StartLayer: 3, EndLayer: 5, PeerID: "tail-spec"}}})
	}
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

	// Verify passes (chains and trees, whose kept branch the tail compacts):
	// a speculating head's text equals plain decoding's with Go sampling,
	// also with the penalties, and fewer tokens than it generated were
	// sampled in the backend.
	for _, m := range []wire.SpeculateMode{wire.SpeculateNGram, wire.SpeculateNGramTree} {
		for _, body := range []map[string]any{
			{"prompt": golden[1].PromptIDs, "max_tokens": 24, "temperature": 0, "ignore_eos": true},
			{"prompt": golden[2].PromptIDs, "max_tokens": 24, "temperature": 0, "repetition_penalty": 1.1, "presence_penalty": 0.2, "ignore_eos": true},
		} {
			before = sampledOn(tailSpec)
			got, err = streamEvents(c, specEnds[m], clone(body))
			if err != nil {
				t.Fatal(err)
			}
			spec := sampledOn(tailSpec) - before
			want, err = streamEvents(c, headHost, clone(body))
			if err != nil {
				t.Fatal(err)
			}
			if ids(t, got) != ids(t, want) {
				t.Errorf("speculate %s %v: %s, plain decoding %s", m, body, ids(t, got), ids(t, want))
			}
			if spec >= 24 {
				t.Errorf("speculate %s: the tail sampled %d of 24 tokens in the backend: no verify pass took the logits path", m, spec)
			}
		}
	}
	waitSessions(t, c, tailEndsURL, tailHostURL, tailSpecURL, localEndsURL, localHostURL)
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

// TestBackendSamplingTailHops drives a tail sampling in the backend and one
// sampling in Go with the same hops (bf16 and f32 rows): prompts, decode
// steps, a retry at the same position, a redo at a lower one (a head going
// back after a dropped pass) and hops without ids. Every reply is the same
// on both, and the backend sampled exactly the steps whose token history
// it holds as the node does: a hop without ids while the penalties read
// them, and every later one of that session, sample in Go.
func TestBackendSamplingTailHops(t *testing.T) {
	testenv.CheckGoroutines(t)
	_, be, load := gocoderLoader(t)
	tailModel := load(3, 5)
	ends := &Server{Model: tailModel, Backend: be, PeerID: "tail-ends"}
	host := &Server{Model: tailModel, Backend: be, PeerID: "tail-host", SampleOnHost: true}
	endsURL, hostURL := startNode(t, ends), startNode(t, host)
	hidden := tailModel.Config.Hidden
	rows := func(dt native.DType, n, seed int) []byte {
		b := make([]byte, n*hidden*dt.Size())
		for i := 0; i < n*hidden; i++ {
			put(b, dt, i, float32(math.Sin(float64(seed*7919+i)))*2)
		}
		return b
	}
	type hop struct {
		pos, n, step int
		ids          bool // the hop names its ids
	}
	const penalties = `"temperature":0.8,"seed":3,"top_p":0.95,"repetition_penalty":1.3,"presence_penalty":0.5,"frequency_penalty":0.4,"logprobs":true,"top_logprobs":3`
	const plain = `"temperature":1.2,"seed":9,"logprobs":true,"top_logprobs":2`
	for _, tc := range []struct {
		session  string
		dt       native.DType
		sampling string
		hops     []hop
		sampled  int64 // in the backend
	}{
		{"penalties", native.BF16, penalties, []hop{{0, 5, 0, true}, {5, 1, 1, true}, {5, 1, 1, true}, {6, 1, 2, true},
			{4, 2, 1, true}, {6, 1, 2, true}, {7, 1, 3, false}, {8, 1, 4, true}, {9, 1, 5, true}}, 6},
		{"no-history", native.F32, plain, []hop{{0, 3, 0, false}, {3, 1, 1, false}, {3, 1, 1, false}, {4, 1, 2, false}, {2, 2, 1, false}}, 5},
	} {
		before := sampledOn(ends)
		var last int32
		for i, h := range tc.hops {
			ids := make([]int32, h.n)
			for j := range ids {
				ids[j] = int32(100 + 13*(h.pos+j))
			}
			if h.pos > 0 && h.n == 1 {
				ids[0] = last // a decode step feeds the last pick
			}
			sampling := fmt.Sprintf(`{%s,"step":%d}`, tc.sampling, h.step)
			if h.ids {
				b, _ := json.Marshal(ids)
				sampling = fmt.Sprintf(`{%s,"step":%d,"tokens":%s}`, tc.sampling, h.step, b)
			}
			req := hopReq{session: tc.session, n: h.n, hidden: hidden, dtype: tc.dt, start: 3, end: 5, pos: h.pos,
				sampling: sampling, body: rows(tc.dt, h.n, h.pos)}
			_, _, got := req.send(t, http.DefaultClient, endsURL)
			_, _, want := req.send(t, http.DefaultClient, hostURL)
			if string(got) != string(want) {
				t.Fatalf("%s hop %d (%+v): backend %s, Go %s", tc.session, i, h, got, want)
			}
			var r wire.TokenReply
			if err := json.Unmarshal(got, &r); err != nil || r.Logprobs == nil || len(r.Logprobs.Top) == 0 {
				t.Fatalf("%s hop %d: %s (%v), want a token with its logprobs", tc.session, i, got, err)
			}
			last = r.Token
		}
		if d := sampledOn(ends) - before; d != tc.sampled {
			t.Errorf("%s: the backend sampled %d of %d hops, want %d", tc.session, d, len(tc.hops), tc.sampled)
		}
	}
}
