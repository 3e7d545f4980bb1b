package tracker

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/tracker/route"
	"meshgpu/wire"
)

// script is the token sequence every fake head generates for any prompt.
var script = []int{11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133}

func tokenText(id int) string { return fmt.Sprintf("t%d ", id) }

// headCall is what a fake head saw.
type headCall struct {
	continueIDs []int
	speculate   string
	maxTokens   int
	route       []wire.Hop
	endLayer    string
	ticket      string // X-Meshnet-Ticket
}

// fakeHead streams script[k:] where k = len(continue_ids), one token per
// chunk with its id, like the node's OpenAI endpoints (protocol "Proxy").
type fakeHead struct {
	t *testing.T
	// fail decides, per request, after how many tokens to fail (-1: never)
	// and how: "abort" (connection broken), "event" (SSE error naming
	// hop), "busy-event" (SSE back-pressure error naming hop), "relay-event"
	// (SSE relay_unreachable naming hop), "expired-event" (SSE
	// ticket_expired naming hop), "500",
	// "429" (a full queue), "stall".
	fail func(call headCall) (after int, how, hop string)
	// delay is the time per streamed token (a generation holds the head).
	delay time.Duration

	mu    sync.Mutex
	calls []headCall
}

func (h *fakeHead) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Stream    bool `json:"stream"`
		MaxTokens *int `json:"max_tokens"`
		Meshgpu   struct {
			ContinueIDs []int  `json:"continue_ids"`
			Speculate   string `json:"speculate"`
		} `json:"meshgpu"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || !req.Stream {
		http.Error(w, `{"error":{"message":"bad request","type":"invalid_request_error"}}`, 400)
		return
	}
	call := headCall{continueIDs: req.Meshgpu.ContinueIDs, speculate: req.Meshgpu.Speculate, maxTokens: -1, endLayer: r.Header.Get("X-Meshnet-End-Layer"), ticket: r.Header.Get(wire.HeaderTicket)}
	if req.MaxTokens != nil {
		call.maxTokens = *req.MaxTokens
	}
	json.Unmarshal([]byte(r.Header.Get("X-Meshnet-Route")), &call.route)
	h.mu.Lock()
	h.calls = append(h.calls, call)
	h.mu.Unlock()
	k := len(call.continueIDs)
	if k > len(script) || !reflect.DeepEqual(call.continueIDs, script[:k:k]) && k > 0 {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(400)
		fmt.Fprintf(w, `{"error":{"message":"continue_ids %v are not a prefix of the script","type":"invalid_request_error"}}`, call.continueIDs)
		return
	}
	after, how, hop := -1, "", ""
	if h.fail != nil {
		after, how, hop = h.fail(call)
	}
	if after == 0 && how == "429" {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(429)
		fmt.Fprint(w, `{"error":{"message":"every session slot is generating and 1024 requests are queued","type":"queue_full"}}`)
		return
	}
	if after == 0 && how == "500" {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(500)
		fmt.Fprintf(w, `{"error":{"message":"layer failed","type":"server_error","hop":%q}}`, hop)
		return
	}
	chat := r.URL.Path == "/v1/chat/completions"
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(200)
	send := func(v any) {
		b, _ := json.Marshal(v)
		fmt.Fprintf(w, "data: %s\n\n", b)
		w.(http.Flusher).Flush()
	}
	choice := func(text string, finish any) map[string]any {
		if chat {
			d := map[string]any{}
			if text != "" {
				d["content"] = text
			}
			return map[string]any{"index": 0, "delta": d, "finish_reason": finish}
		}
		return map[string]any{"index": 0, "text": text, "finish_reason": finish}
	}
	if chat {
		send(map[string]any{"id": "head-x", "object": "chat.completion.chunk", "choices": []any{
			map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""}, "finish_reason": nil}}})
	}
	end := len(script)
	finish := "stop"
	if call.maxTokens >= 0 && k+call.maxTokens < end {
		end, finish = k+call.maxTokens, "length"
	}
	// failNow fails the request when n tokens have been sent.
	failNow := func(n int) bool {
		if n != after {
			return false
		}
		switch how {
		case "abort":
			panic(http.ErrAbortHandler)
		case "event":
			send(map[string]any{"error": map[string]any{"message": "hop timed out", "type": "upstream_error", "hop": hop}})
			return true
		case "relay-event": // the head could not reach hop through its relay
			send(map[string]any{"error": map[string]any{"message": "hop to " + hop + " failed: relay ws://127.0.0.1:1 cannot reach it", "type": wire.TypeRelayUnreachable, "hop": hop}})
			return true
		case "busy-event":
			send(map[string]any{"error": map[string]any{"message": "this node holds its maximum of 64 sessions", "type": "too_many_sessions", "hop": hop}})
			return true
		case "expired-event": // hop refused the session's route ticket as expired
			send(map[string]any{"error": map[string]any{"message": "session s: its route ticket expired", "type": wire.TypeTicketExpired, "hop": hop}})
			return true
		case "stall":
			<-r.Context().Done()
			return true
		}
		return false
	}
	n := 0
	for i := k; i < end; i, n = i+1, n+1 {
		if failNow(n) {
			return
		}
		time.Sleep(h.delay)
		send(map[string]any{"id": "head-x", "object": "chunk", "choices": []any{choice(tokenText(script[i]), nil)}, "meshgpu": map[string]any{"token": script[i]}})
	}
	if failNow(n) {
		return
	}
	send(map[string]any{"id": "head-x", "object": "chunk", "choices": []any{choice("", finish)},
		"usage": map[string]any{"prompt_tokens": 5, "completion_tokens": end - k, "total_tokens": 5 + end - k}})
	fmt.Fprint(w, "data: [DONE]\n\n")
}

func (h *fakeHead) Calls() []headCall {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]headCall(nil), h.calls...)
}

// startHead serves a fake head on 127.0.0.1.
func startHead(t *testing.T, h *fakeHead) *httptest.Server {
	ts := httptest.NewServer(h)
	t.Cleanup(ts.Close)
	return ts
}

// streamResult is what an OpenAI client assembles from a stream.
type streamResult struct {
	text    string
	ids     map[string]bool
	roles   int
	done    bool
	finish  string
	errored string
}

func readStream(t *testing.T, body io.Reader, chat bool) streamResult {
	return readStreamFrom(t, body, chat, true)
}

// readStreamFrom reads a stream; fromTracker also checks that the
// tracker passed on only the token id of the head's meshgpu field.
func readStreamFrom(t *testing.T, body io.Reader, chat, fromTracker bool) streamResult {
	t.Helper()
	res := streamResult{ids: map[string]bool{}}
	sc := bufio.NewScanner(body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "data: ") {
			continue
		}
		data := strings.TrimPrefix(line, "data: ")
		if data == "[DONE]" {
			res.done = true
			continue
		}
		var c struct {
			ID      string `json:"id"`
			Choices []struct {
				Text  string `json:"text"`
				Delta struct {
					Role    string `json:"role"`
					Content string `json:"content"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
			Error   *struct{ Message string } `json:"error"`
			Meshgpu map[string]any            `json:"meshgpu"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("chunk is not JSON: %s", data)
		}
		if c.Error != nil {
			res.errored = c.Error.Message
			continue
		}
		if _, hasToken := c.Meshgpu["token"]; fromTracker && c.Meshgpu != nil && (len(c.Meshgpu) != 1 || !hasToken) {
			t.Fatalf("tracker leaked more than the token id of the meshgpu field to the client: %s", data)
		}
		res.ids[c.ID] = true
		for _, ch := range c.Choices {
			if chat {
				res.text += ch.Delta.Content
				if ch.Delta.Role != "" {
					res.roles++
				}
			} else {
				res.text += ch.Text
			}
			if ch.FinishReason != nil {
				res.finish = *ch.FinishReason
			}
		}
	}
	return res
}

// proxyMesh is a tracker with fake heads registered as nodes.
type proxyMesh struct {
	tracker *httptest.Server
	srv     *Server
	hc      *http.Client
	clk     *clock
}

func newProxyMesh(t *testing.T, cfg Config) *proxyMesh {
	clk := newClock()
	cfg.Clock = clk.Now
	srv, ts := startTracker(t, cfg)
	return &proxyMesh{tracker: ts, srv: srv, hc: httpClient(t), clk: clk}
}

// node registers a node with endpoint for layers first-last of 6.
func (m *proxyMesh) node(t *testing.T, endpoint string, first, last int, ms float64) string {
	c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	mustRegister(t, c, reg(endpoint, first, last, 6, ms))
	return c.Identity.PeerID
}

func (m *proxyMesh) post(t *testing.T, path, body string) *http.Response {
	t.Helper()
	resp, err := m.hc.Post(m.tracker.URL+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

const chatBody = `{"model":"gocoder-6m","messages":[{"role":"user","content":"write Go"}],"max_tokens":10,"stream":true}`

// reference runs the request through a tracker whose only head never fails.
func reference(t *testing.T, path, body string, chat bool) streamResult {
	m := newProxyMesh(t, Config{})
	h := startHead(t, &fakeHead{t: t})
	m.node(t, h.URL, 0, 5, 1)
	res := readStream(t, m.post(t, path, body).Body, chat)
	if !res.done || res.text == "" || res.errored != "" {
		t.Fatalf("reference run failed: %+v", res)
	}
	return res
}

func TestProxyFailoverKeepsOneStream(t *testing.T) {
	testenv.CheckGoroutines(t)
	for _, tc := range []struct {
		name, path, body string
		chat             bool
		how              string
	}{
		{"chat, connection broken", "/v1/chat/completions", chatBody, true, "abort"},
		{"completions, connection broken", "/v1/completions", `{"model":"gocoder-6m","prompt":"func main","max_tokens":10,"stream":true}`, false, "abort"},
		{"chat, head stalls past the token timeout", "/v1/chat/completions", chatBody, true, "stall"},
		{"chat, 500 before streaming", "/v1/chat/completions", chatBody, true, "500"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want := reference(t, tc.path, tc.body, tc.chat)
			m := newProxyMesh(t, Config{TokenTimeout: 300 * time.Millisecond})
			after := 4
			if tc.how == "500" {
				after = 0
			}
			dying := &fakeHead{t: t, fail: func(headCall) (int, string, string) { return after, tc.how, "" }}
			spare := &fakeHead{t: t}
			hd, hs := startHead(t, dying), startHead(t, spare)
			dyingID := m.node(t, hd.URL, 0, 5, 1) // faster: routed first
			m.node(t, hs.URL, 0, 5, 2)
			got := readStream(t, m.post(t, tc.path, tc.body).Body, tc.chat)
			if got.text != want.text || !got.done || got.finish != want.finish || got.errored != "" {
				t.Fatalf("failover stream %+v\nwant text %q finish %q", got, want.text, want.finish)
			}
			if len(got.ids) != 1 || (tc.chat && got.roles != 1) {
				t.Fatalf("client saw %d stream ids and %d role chunks, want one each", len(got.ids), got.roles)
			}
			calls := spare.Calls()
			if len(calls) != 1 {
				t.Fatalf("spare head called %d times", len(calls))
			}
			if c := calls[0]; len(c.continueIDs) != after || c.maxTokens != 10-after || c.endLayer != "5" || len(c.route) != 0 {
				t.Fatalf("replay request %+v: want %d continue ids, max_tokens %d, end layer 5, empty route", c, after, 10-after)
			}
			// The failed head is banned: the next request goes to the spare.
			readStream(t, m.post(t, tc.path, tc.body).Body, tc.chat)
			if n := len(dying.Calls()); n != 1 {
				t.Fatalf("banned head %s called %d times, want 1", dyingID, n)
			}
		})
	}
}

func TestProxyBansTheHopTheHeadNames(t *testing.T) {
	testenv.CheckGoroutines(t)
	want := reference(t, "/v1/chat/completions", chatBody, true)
	m := newProxyMesh(t, Config{})
	var m1 string
	head := &fakeHead{t: t, fail: func(c headCall) (int, string, string) {
		for _, h := range c.route {
			if h.PeerID == m1 {
				return 3, "event", h.Endpoint // downstream node failed; the head names it
			}
		}
		return -1, "", ""
	}}
	h := startHead(t, head)
	m.node(t, h.URL, 0, 2, 1)
	m1 = m.node(t, "http://127.0.0.1:1", 3, 5, 1) // never contacted by the tracker
	m2 := m.node(t, "http://127.0.0.1:2", 3, 5, 2)
	resp := m.post(t, "/v1/chat/completions", strings.Replace(chatBody, `"stream":true`, `"stream":false`, 1))
	var out struct {
		Choices []struct {
			Message struct{ Content string }
		}
		Usage struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
			TotalTokens      int `json:"total_tokens"`
		}
	}
	b, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(b, &out); err != nil || resp.StatusCode != 200 || len(out.Choices) != 1 {
		t.Fatalf("non-streaming answer %d %s", resp.StatusCode, b)
	}
	if out.Choices[0].Message.Content != want.text || out.Usage.CompletionTokens != 10 || out.Usage.PromptTokens != 5 || out.Usage.TotalTokens != 15 {
		t.Fatalf("assembled %q (usage %+v), want %q (5 + 10 tokens)", out.Choices[0].Message.Content, out.Usage, want.text)
	}
	calls := head.Calls()
	if len(calls) != 2 || calls[1].route[0].PeerID != m2 || calls[1].route[0].StartLayer != 3 || calls[1].endLayer != "2" {
		t.Fatalf("head calls %+v: want the replay routed through %s", calls, m2)
	}
	if len(calls[1].continueIDs) != 3 {
		t.Fatalf("replay continued from %v, want 3 ids", calls[1].continueIDs)
	}
}

func TestProxyErrors(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{MaxAttempts: 2})
	always := &fakeHead{t: t, fail: func(headCall) (int, string, string) { return 2, "abort", "" }}
	h := startHead(t, always)
	m.node(t, h.URL, 0, 5, 1)
	for _, tc := range []struct {
		path, body string
		status     int
	}{
		{"/v1/chat/completions", `{"model":"gocoder-6m","messages":"hi"}`, 400},
		{"/v1/chat/completions", `not json`, 400},
		{"/v1/completions", `{"model":"gocoder-6m","prompt":"x","n":17}`, 400},
		{"/v1/completions", `{"model":"gocoder-6m","prompt":"x","max_tokens":-1}`, 400},
		{"/v1/completions", `{"model":"other","prompt":"x"}`, 404},
		{"/v1/completions", `{"model":"gocoder-6m","prompt":"x","meshgpu":{"continue_ids":[1]}}`, 400},
		{"/v1/completions", `{"model":"gocoder-6m","prompt":"x","meshgpu":{"speculate":"off","continue_ids":[1]}}`, 400},
		{"/v1/completions", `{"model":"gocoder-6m","prompt":"x","meshgpu":{"speculate":"always"}}`, 400},
		{"/v1/completions", `{"model":"gocoder-6m","prompt":"x","meshgpu":{"speculate":1}}`, 400},
		{"/v1/completions", `{"model":"gocoder-6m","prompt":"x","meshgpu":[1]}`, 400},
	} {
		resp := m.post(t, tc.path, tc.body)
		var e map[string]map[string]any
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != tc.status || json.Unmarshal(b, &e) != nil || e["error"]["message"] == "" {
			t.Errorf("%s %s: %d %s, want %d with a JSON error", tc.path, tc.body, resp.StatusCode, b, tc.status)
		}
	}
	// The only head dies: the stream reports an error event, no [DONE].
	got := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
	if got.done || got.errored == "" || got.text != tokenText(11)+tokenText(22) {
		t.Fatalf("dying mesh: %+v", got)
	}
	// Now it is banned and nothing is left: 503 before any byte is sent.
	// (Registered again below for the next case.)
	resp := m.post(t, "/v1/chat/completions", chatBody)
	if resp.StatusCode != 503 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("no route: %d %s", resp.StatusCode, b)
	}
	var models struct{ Data []struct{ ID string } }
	if st := getJSON(t, m.hc, m.tracker.URL+"/v1/models", &models); st != 200 || len(models.Data) != 1 || models.Data[0].ID != "gocoder-6m" {
		t.Fatalf("models: %d %+v", st, models)
	}
}

// BenchmarkProxyOverheadPerToken streams 64 tokens from a fake head,
// directly and through the tracker, in the same run; it reports ns per
// token for both and their ratio.
func BenchmarkProxyOverheadPerToken(b *testing.B) {
	head := httptest.NewServer(&fakeHead{})
	defer head.Close()
	srv := NewServer(Config{Logger: quietLogger(), Endpoints: AddrPolicy{AllowLoopback: true}, SkipEndpointCheck: true})
	ts := httptest.NewServer(srv.Handler())
	defer ts.Close()
	id := newIdentity(b)
	body, _ := Sign(id, KindRegister, time.Now(), ptr(reg(head.URL, 0, 5, 6, 1)))
	if _, err := srv.Registry().Register(context.Background(), body); err != nil {
		b.Fatal(err)
	}
	hc := &http.Client{}
	defer hc.CloseIdleConnections()
	req := `{"model":"gocoder-6m","prompt":"x","max_tokens":64,"stream":true}`
	run := func(url string) time.Duration {
		start := time.Now()
		resp, err := hc.Post(url+"/v1/completions", "application/json", strings.NewReader(req))
		if err != nil {
			b.Fatal(err)
		}
		n, _ := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if n == 0 {
			b.Fatal("empty stream")
		}
		return time.Since(start)
	}
	tokens := float64(len(script))
	var direct, proxied time.Duration
	for b.Loop() {
		direct += run(head.URL)
		proxied += run(ts.URL)
	}
	b.ReportMetric(float64(direct.Nanoseconds())/float64(b.N)/tokens, "direct-ns/token")
	b.ReportMetric(float64(proxied.Nanoseconds())/float64(b.N)/tokens, "tracker-ns/token")
	b.ReportMetric(float64(proxied)/float64(direct), "tracker/direct")
}

// BenchmarkRegistryRoute500x80 is GET /route's work without HTTP: 500
// registered nodes over 80 layers, read from the store, expired,
// converted and routed.
func BenchmarkRegistryRoute500x80(b *testing.B) {
	clk := newClock()
	g := NewRegistry(nil, clk.Now, time.Minute, 0, route.Config{})
	g.SetAdmission(AddrPolicy{AllowLoopback: true}, nil, nil)
	for i := 0; i < 500; i++ {
		id := newIdentity(b)
		first := (i * 7) % 80
		last := min(first+4+i%12, 79)
		body, _ := Sign(id, KindRegister, clk.Now(), ptr(reg(fmt.Sprintf("http://127.0.0.1:%d", 9000+i), first, last, 80, 0.2+float64(i%17)/4)))
		if _, err := g.Register(context.Background(), body); err != nil {
			b.Fatal(err)
		}
	}
	for i := 0; b.Loop(); i++ {
		if _, err := g.Route(context.Background(), "gocoder-6m", uint64(i)); err != nil {
			b.Fatal(err)
		}
	}
}

// relayStub stands in for relay.Client: it serves the request with the
// head's handler in-process and records the relay address used.
type relayStub struct {
	head  http.Handler
	mu    sync.Mutex
	addrs []string
}

func (r *relayStub) Do(ctx context.Context, relayAddr string, req *http.Request) (*http.Response, error) {
	r.mu.Lock()
	r.addrs = append(r.addrs, relayAddr)
	r.mu.Unlock()
	rec := httptest.NewRecorder()
	r.head.ServeHTTP(rec, req.WithContext(ctx))
	return rec.Result(), nil
}

func TestProxyReachesRelayOnlyHeadThroughTheRelay(t *testing.T) {
	testenv.CheckGoroutines(t)
	want := reference(t, "/v1/completions", `{"model":"gocoder-6m","prompt":"x","max_tokens":6,"stream":true}`, false)
	stub := &relayStub{head: &fakeHead{t: t}}
	m := newProxyMesh(t, Config{Relay: stub})
	c := &Client{URL: m.tracker.URL, Identity: newIdentity(t), HTTP: m.hc, Clock: m.clk.Now}
	r := reg("", 0, 5, 6, 1)
	r.RelayAddr = "ws://127.0.0.1:7000/rpc/" + c.Identity.PeerID
	mustRegister(t, c, r)
	got := readStream(t, m.post(t, "/v1/completions", `{"model":"gocoder-6m","prompt":"x","max_tokens":6,"stream":true}`).Body, false)
	if got.text != want.text || !got.done {
		t.Fatalf("via relay: %+v, want %q", got, want.text)
	}
	if len(stub.addrs) != 1 || stub.addrs[0] != r.RelayAddr {
		t.Fatalf("relay addresses used: %v", stub.addrs)
	}
}

// A head that dies right after the last token: nothing is left to
// generate, so the stream ends normally without a replay.
func TestProxyFinishesWhenOnlyTheFinalChunkIsMissing(t *testing.T) {
	testenv.CheckGoroutines(t)
	want := reference(t, "/v1/chat/completions", chatBody, true)
	m := newProxyMesh(t, Config{})
	h := startHead(t, &fakeHead{t: t, fail: func(headCall) (int, string, string) { return 10, "abort", "" }})
	m.node(t, h.URL, 0, 5, 1)
	got := readStream(t, m.post(t, "/v1/chat/completions", chatBody).Body, true)
	if got.text != want.text || !got.done || got.finish != "length" || got.errored != "" {
		t.Fatalf("got %+v, want the full text with finish length", got)
	}
}

// A client's meshgpu.speculate reaches the head as written, and the
// failover replay keeps it next to the tracker's continue_ids.
func TestProxyPassesSpeculateThroughFailover(t *testing.T) {
	testenv.CheckGoroutines(t)
	m := newProxyMesh(t, Config{TokenTimeout: 300 * time.Millisecond})
	dying := &fakeHead{t: t, fail: func(headCall) (int, string, string) { return 3, "abort", "" }}
	spare := &fakeHead{t: t}
	hd, hs := startHead(t, dying), startHead(t, spare)
	m.node(t, hd.URL, 0, 5, 1)
	m.node(t, hs.URL, 0, 5, 2)
	body := `{"model":"gocoder-6m","prompt":"func main","max_tokens":10,"stream":true,"meshgpu":{"speculate":"off"}}`
	got := readStream(t, m.post(t, "/v1/completions", body).Body, false)
	if !got.done || got.errored != "" {
		t.Fatalf("stream %+v", got)
	}
	first, replay := dying.Calls(), spare.Calls()
	if len(first) != 1 || first[0].speculate != "off" || len(first[0].continueIDs) != 0 {
		t.Fatalf("first head saw %+v, want speculate off and no continue_ids", first)
	}
	if len(replay) != 1 || replay[0].speculate != "off" || len(replay[0].continueIDs) != 3 {
		t.Fatalf("replay head saw %+v, want speculate off and 3 continue_ids", replay)
	}
}
