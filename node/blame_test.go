package node

import (
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/hopmux"
	"meshgpu/internal/metricstest"
	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/openai"
	"meshgpu/sample"
	"meshgpu/wire"
)

// lyingTail is a real node behind a hop-frame front that rewrites every
// token answer with lie: a tail that computes honestly and then reports
// values no sampler produces.
type lyingTail struct {
	*Server
	lie   func(*wire.HopReply)
	conns HopConns
	mu    sync.Mutex
	lies  int
}

func (l *lyingTail) AcceptHop(ctx context.Context, h *wire.HopHead) hopmux.Hop {
	hop := l.Server.AcceptHop(ctx, h)
	if hopmux.Refused(hop) != nil {
		return hop
	}
	return hopmux.Accept(hop.Payload(), func(ctx context.Context, ok bool) *wire.HopReply {
		rep := hop.Serve(ctx, ok)
		if rep != nil && rep.Kind == wire.ReplyToken {
			l.lie(rep)
			l.mu.Lock()
			l.lies++
			l.mu.Unlock()
		}
		return rep
	})
}

func (l *lyingTail) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == wire.HopPath {
		l.conns.Serve(w, r, l, nil)
		return
	}
	l.Server.Handler().ServeHTTP(w, r)
}

func startLyingTail(t *testing.T, s *Server, lie func(*wire.HopReply)) (*lyingTail, string) {
	t.Helper()
	s.Logger = quietLogger()
	l := &lyingTail{Server: s, lie: lie}
	url, stop := serve(t, l)
	t.Cleanup(func() { l.conns.Close(); stop(); s.Close() })
	return l, url
}

// A tail that answers a hop with a NaN, infinite or positive logprob, or
// with alternatives outside the vocabulary, is the one blamed: the node it
// answered refuses the answer with a 502 naming the tail (so a tracker bans
// the tail, not the head), whether the head hears it directly or through
// an honest middle node, and nothing of the answer reaches a client. Before,
// the head put the NaN into its JSON answer, failed to encode it and named
// itself as the failed hop.
func TestLyingTailAnswerIsTheTailsFault(t *testing.T) {
	testenv.CheckGoroutines(t)
	for name, lie := range map[string]func(*wire.HopReply){
		"NaN logprob":           func(r *wire.HopReply) { r.Logprob = float32(math.NaN()) },
		"+Inf logprob":          func(r *wire.HopReply) { r.Logprob = float32(math.Inf(1)) },
		"positive logprob":      func(r *wire.HopReply) { r.Logprob = 5 },
		"NaN model logprob":     func(r *wire.HopReply) { r.Logprobs.Logprob = float32(math.NaN()) },
		"-Inf top logprob":      func(r *wire.HopReply) { r.Logprobs.Top[0].Logprob = float32(math.Inf(-1)) },
		"top id beyond vocab":   func(r *wire.HopReply) { r.Logprobs.Top[1].ID = fkVocab + 7 },
		"token id beyond vocab": func(r *wire.HopReply) { r.Token = fkVocab },
	} {
		t.Run(name, func(t *testing.T) {
			liar, liarURL := startLyingTail(t, &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "liar"}, lie)
			head := &Server{StackForTesting: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab), PeerID: "head", Logger: quietLogger()}
			t.Cleanup(func() { head.Close() })
			p := headPipeline(t, head, "lie-direct", []wire.Hop{{Endpoint: liarURL, StartLayer: 3, EndLayer: 5}})
			p.params = sample.Params{Logprobs: true, TopLogprobs: 3}
			_, _, ae := p.step(context.Background(), 0, []int32{1}, 0)
			if ae == nil || ae.Status != http.StatusBadGateway || ae.Hop != liarURL || ae.Type != "bad_hop_response" {
				t.Fatalf("a lying tail's answer: %+v, want 502 bad_hop_response naming %s", ae, liarURL)
			}
			if p.logprobs != nil || p.stepLogprobs != nil {
				t.Errorf("the lie was kept for the client: %v %v", p.logprobs, p.stepLogprobs)
			}

			// Through an honest middle node: the middle refuses the answer
			// and names the tail; the head passes that on.
			mid := &Server{StackForTesting: newFakeStack(2, 2, fkLayers, fkHidden, fkVocab), PeerID: "mid"}
			midURL := startNode(t, mid)
			head2 := &Server{StackForTesting: newFakeStack(0, 1, fkLayers, fkHidden, fkVocab), PeerID: "head2", Logger: quietLogger()}
			t.Cleanup(func() { head2.Close() })
			head2.Handler()
			sess, _ := head2.sessions.get("lie-chain", 0)
			t.Cleanup(func() { head2.sessions.remove("lie-chain") })
			p2 := &pipeline{s: head2, sess: sess, id: "lie-chain", headEnd: 1, dtype: native.BF16,
				route:  []wire.Hop{{Endpoint: midURL, StartLayer: 2, EndLayer: 2}, {Endpoint: liarURL, StartLayer: 3, EndLayer: 5}},
				params: sample.Params{Logprobs: true, TopLogprobs: 3}}
			_, _, ae = p2.step(context.Background(), 0, []int32{1}, 0)
			if ae == nil || ae.Status != http.StatusBadGateway || ae.Hop != liarURL {
				t.Fatalf("a lying tail behind a middle node: %+v, want 502 naming %s (not the middle node)", ae, liarURL)
			}
			if n, _ := metricstest.Value(metricstest.Scrape(t, http.DefaultClient, midURL+"/metrics"), "meshgpu_node_hop_answers_refused_total"); n < 1 {
				t.Errorf("the middle node counted %v refused answers, want at least 1", n)
			}
			liar.mu.Lock()
			lies := liar.lies
			liar.mu.Unlock()
			if lies < 2 {
				t.Fatalf("the liar lied %d times: the test tested nothing", lies)
			}
		})
	}
	// The same tail, honest, answers: the checks refuse only lies.
	honest, url := startLyingTail(t, &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "honest"}, func(*wire.HopReply) {})
	head := &Server{StackForTesting: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab), PeerID: "head", Logger: quietLogger()}
	t.Cleanup(func() { head.Close() })
	p := headPipeline(t, head, "honest", []wire.Hop{{Endpoint: url, StartLayer: 3, EndLayer: 5}})
	p.params = sample.Params{Logprobs: true, TopLogprobs: 3}
	if id, _, ae := p.step(context.Background(), 0, []int32{1}, 0); ae != nil || id != wantToken(1) {
		t.Fatalf("an honest tail behind the same front: %d %+v", id, ae)
	}
	if honest.lies != 1 {
		t.Fatalf("the front saw %d answers, want 1", honest.lies)
	}
}

// A node sending finite activations no model produces (f32 3e38, bf16's
// largest value: the receiver's norm overflows, its logits come out
// uniform and it sampled token 0 without an error), or NaN, is refused by
// the node it sent them to, with a 422 naming it, which the head turns into
// a 502 naming it. The refusing node frees the session at once (it kept it
// for the session TTL, 10 minutes).
func TestBadActivationsBlameTheSenderAndFreeTheSession(t *testing.T) {
	testenv.CheckGoroutines(t)
	for name, tc := range map[string]struct {
		out   float32
		dtype native.DType
		typ   string
	}{
		"f32 3e38": {3e38, native.F32, "activations_out_of_range"},
		"bf16 max": {math.Float32frombits(0x7f7f0000), native.BF16, "activations_out_of_range"},
		"f32 2^20": {1 << 20, native.F32, "activations_out_of_range"},
		"bf16 NaN": {float32(math.NaN()), native.BF16, "non_finite_activations"},
		"f32 -Inf": {float32(math.Inf(-1)), native.F32, "non_finite_activations"},
	} {
		t.Run(name, func(t *testing.T) {
			headID := newID(t)
			head := &Server{StackForTesting: newFakeStack(0, 1, fkLayers, fkHidden, fkVocab), PeerID: headID.PeerID, Identity: headID, Logger: quietLogger()}
			t.Cleanup(func() { head.Close() })
			bad := newFakeStack(2, 2, fkLayers, fkHidden, fkVocab)
			bad.constOut = tc.out
			mid := &Server{StackForTesting: bad, PeerID: "mid", TrustedHeads: []string{headID.PeerID}}
			midURL := startNode(t, mid)
			tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail", TrustedHeads: []string{headID.PeerID}}
			tailURL := startNode(t, tail)
			p, _ := ticketedPipeline(t, head, []wire.Hop{{Endpoint: midURL, StartLayer: 2, EndLayer: 2, PeerID: "mid"}, {Endpoint: tailURL, StartLayer: 3, EndLayer: 5, PeerID: "tail"}})
			p.dtype = tc.dtype
			_, _, ae := p.step(context.Background(), 0, []int32{1}, 0)
			if ae == nil || ae.Status != http.StatusBadGateway || ae.Type != tc.typ || ae.Hop != "mid" {
				t.Fatalf("activations of %v from mid: %+v, want 502 %s naming mid", tc.out, ae, tc.typ)
			}
			if n := tail.sessions.len(); n != 0 {
				t.Errorf("the tail kept %d sessions after refusing the hop, want 0 at once", n)
			}
			if n, _ := metricstest.Value(metricstest.Scrape(t, http.DefaultClient, tailURL+"/metrics"), "meshgpu_node_hops_non_finite_total"); n != 1 {
				t.Errorf("the tail counted %v refused hops, want 1", n)
			}
		})
	}
	// The largest magnitude below the bound still runs.
	tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab), PeerID: "tail"}
	url := startNode(t, tail)
	body := make([]byte, 4*fkHidden)
	for i := 0; i < fkHidden; i++ {
		put(body, native.F32, i, math.Float32frombits(0x497fffff)) // just below 2^20
	}
	if st, _, b := (hopReq{session: "below", n: 1, hidden: fkHidden, dtype: native.F32, start: 3, end: 5, body: body}).send(t, http.DefaultClient, url); st != 200 {
		t.Fatalf("activations below the bound: %d %s", st, b)
	}
}

// A static head (its operator's --peer route, no tracker to go elsewhere)
// queues behind a tail whose session slots are all taken instead of passing
// its 429 too_many_sessions to clients: more concurrent requests than the
// tail has slots all get the answer a lone request gets, and no session is
// left on either node. Before, most of them failed with the tail's 429.
func TestStaticHeadQueuesBehindBusyTail(t *testing.T) {
	testenv.CheckGoroutines(t)
	tm, tbe := loadGocoder(t, 3, 5)
	tail := &Server{Model: tm, Backend: tbe, MaxSessions: 2}
	tailURL := startNode(t, tail)
	hm, hbe := loadGocoder(t, 0, 2)
	head := &Server{Model: hm, Backend: hbe, MaxSessions: 12, Peers: []string{tailURL}, QueueWait: 50 * time.Second}
	headURL := startNode(t, head)
	c := &http.Client{Timeout: 90 * time.Second}
	defer c.CloseIdleConnections()
	body := map[string]any{"prompt": "func main() {", "max_tokens": 24, "temperature": 0, "ignore_eos": true}
	want, _ := postOK(t, c, headURL+"/v1/completions", body)

	const n = 10
	var wg sync.WaitGroup
	got := make([]string, n)
	status := make([]int, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := postJSON(context.Background(), c, headURL+"/v1/completions", body)
			if err != nil {
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			status[i] = resp.StatusCode
			var out openai.Completion
			if json.Unmarshal(b, &out) == nil && len(out.Choices) == 1 && out.Choices[0].Text != nil {
				got[i] = *out.Choices[0].Text
			} else {
				got[i] = string(b)
			}
		}()
	}
	wg.Wait()
	failed := 0
	for i := range got {
		if status[i] != 200 || got[i] != *want.Choices[0].Text {
			failed++
			t.Errorf("request %d of %d over a tail with 2 slots: %d %q, want 200 %q", i, n, status[i], got[i], *want.Choices[0].Text)
		}
	}
	if v, _ := metricstest.Value(metricstest.Scrape(t, c, tailURL+"/metrics"), "meshgpu_node_errors_total", "type=too_many_sessions"); failed == 0 && v == 0 {
		t.Errorf("the tail never answered too_many_sessions: the requests did not overlap, and the test tested nothing")
	}
	waitSessions(t, c, tailURL, headURL)
	if n := tail.sessions.len() + head.sessions.len(); n != 0 {
		t.Fatalf("%d sessions left after every request finished", n)
	}
}

// continue_ids are the tracker's; a client sending them straight to a head
// is told what is wrong with them, not that its prompt is too long.
func TestContinueIDsTooLongSaysSo(t *testing.T) {
	m, be := loadGocoder(t, 0, -1)
	u := startNode(t, &Server{Model: m, Backend: be, MaxContext: 64})
	ids := make([]int64, 80)
	for i := range ids {
		ids[i] = 100
	}
	resp, err := postJSON(context.Background(), http.DefaultClient, u+"/v1/completions",
		map[string]any{"prompt": "hi", "max_tokens": 4, "meshgpu": map[string]any{"continue_ids": ids}})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	we, ok := wire.DecodeError(resp.StatusCode, b)
	if resp.StatusCode != 400 || !ok || we.Param != "meshgpu.continue_ids" || !strings.Contains(we.Message, "continue_ids (80 ids)") {
		t.Fatalf("continue_ids past the context: %d %s, want 400 naming meshgpu.continue_ids and their count", resp.StatusCode, b)
	}
}
