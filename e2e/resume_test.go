package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"meshgpu/daemon"
	"meshgpu/internal/testenv"
	"meshgpu/wire"
)

// tokenChunks posts a streamed completion and returns the text of the
// chunks that carry a token id (what a proxy has relayed when the head dies
// right after them) and the whole streamed text.
func tokenChunks(t *testing.T, hc *http.Client, url string, body map[string]any) (tokText, all string, ids []int64) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := hc.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	var tok, whole strings.Builder
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var c struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
			Meshgpu *struct {
				Token int64 `json:"token"`
			} `json:"meshgpu"`
			Error any `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil || c.Error != nil {
			t.Fatalf("event %s: %v", data, err)
		}
		for _, ch := range c.Choices {
			whole.WriteString(ch.Text)
			if c.Meshgpu != nil {
				tok.WriteString(ch.Text)
			}
		}
		if c.Meshgpu != nil {
			ids = append(ids, c.Meshgpu.Token)
		}
	}
	return tok.String(), whole.String(), ids
}

// The tracker's failover replays a request with continue_ids = the ids
// streamed so far. Whatever the cut, the text the first attempt streamed
// with those ids plus the text of the replay must equal the uninterrupted
// stream, also when text was held back at the cut: here a stop string whose
// prefix appears in the output (so the head holds text back until it stops
// matching) and which never completes.
func TestResumedStreamLosesNoHeldBackText(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	be := openCPU(t)
	n, err := daemon.Start(context.Background(), daemon.Config{ModelDir: dir, Backend: be, Identity: newIdentity(t),
		Last: -1, MaxSessions: 4, MaxContext: 256, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	hc := newHTTPClient(t)
	url := n.URL() + "/v1/completions"
	const maxTokens = 24
	prompt := "package main\n\nimport (\n"
	base := map[string]any{"prompt": prompt, "max_tokens": maxTokens, "temperature": 0, "ignore_eos": true, "stream": true}
	_, plain, _ := tokenChunks(t, hc, url, base)
	if len(plain) < 20 {
		t.Fatalf("too little text to test with: %q", plain)
	}
	// A stop string made of a stretch of the output plus a byte that never
	// follows it: the head holds that stretch back while it matches.
	stop := plain[len(plain)/3:len(plain)/3+8] + "\x01"
	with := func(k int, cont []int64) map[string]any {
		m := map[string]any{}
		for key, v := range base {
			m[key] = v
		}
		m["stop"] = stop
		m["max_tokens"] = k
		if cont != nil {
			m["meshgpu"] = map[string]any{"continue_ids": cont}
		}
		return m
	}
	_, whole, ids := tokenChunks(t, hc, url, with(maxTokens, nil))
	if whole != plain || len(ids) != maxTokens {
		t.Fatalf("with the never-matching stop string: %q (%d ids), without: %q", whole, len(ids), plain)
	}
	deadline := time.Now().Add(30 * time.Second)
	for k := 1; k < maxTokens && time.Now().Before(deadline); k++ {
		before, _, firstIDs := tokenChunks(t, hc, url, with(k, nil))
		_, after, _ := tokenChunks(t, hc, url, with(maxTokens-k, firstIDs))
		if before+after != whole {
			t.Errorf("cut after %d tokens: %q + %q\nuninterrupted: %q", k, before, after, whole)
		}
	}
}

// Failover replay with speculative decoding on: a head that drafts by
// prompt lookup gives, sampling at temperature 0.8 with a seed, the text
// plain decoding gives, and a replay cut after any k tokens (continue_ids
// as the tracker sends them) continues it exactly, although the replay's
// drafts and draft lengths differ from the first attempt's. Seed 1 samples
// text that repeats the prompt's n-grams with f32 and with bf16 products
// alike (17 drafts accepted on either; seed 7's text repeated them only
// with f32 products), so drafts are accepted on every CPU path.
func TestSpeculativeReplayMatchesPlain(t *testing.T) {
	dir := testenv.GoCoder(t)
	testenv.CheckGoroutines(t)
	be := openCPU(t)
	n, err := daemon.Start(context.Background(), daemon.Config{ModelDir: dir, Backend: be, Identity: newIdentity(t),
		Last: -1, MaxSessions: 4, MaxContext: 256, Speculate: wire.SpeculateNGram, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	hc := newHTTPClient(t)
	url := n.URL() + "/v1/completions"
	const maxTokens = 32
	req := func(k int, spec string, cont []int64) map[string]any {
		m := map[string]any{"prompt": "func add(a, b int) int {\n\treturn a + b\n}\n\nfunc sub(a, b int) int {\n", "max_tokens": k,
			"temperature": 0.8, "seed": 1, "ignore_eos": true, "stream": true}
		ext := map[string]any{"speculate": spec}
		if cont != nil {
			ext["continue_ids"] = cont
		}
		m["meshgpu"] = ext
		return m
	}
	_, plain, _ := tokenChunks(t, hc, url, req(maxTokens, "off", nil))
	_, spec, ids := tokenChunks(t, hc, url, req(maxTokens, "ngram", nil))
	if spec != plain || len(ids) != maxTokens {
		t.Fatalf("speculative %q (%d ids), plain %q", spec, len(ids), plain)
	}
	for _, k := range []int{1, 3, 8, 17, 30} {
		before, _, firstIDs := tokenChunks(t, hc, url, req(k, "ngram", nil))
		_, after, _ := tokenChunks(t, hc, url, req(maxTokens-k, "ngram", firstIDs))
		if before+after != plain {
			t.Errorf("cut after %d tokens: %q + %q\nuninterrupted: %q", k, before, after, plain)
		}
	}
	var st struct {
		Drafted  int64 `json:"speculative_draft_tokens"`
		Accepted int64 `json:"speculative_accepted_tokens"`
	}
	getJSON(t, hc, n.URL()+"/stats", &st)
	if st.Accepted == 0 {
		t.Errorf("no draft accepted (%d drafted): the test ran plain decoding only", st.Drafted)
	}
}
