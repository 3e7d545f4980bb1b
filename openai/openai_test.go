package openai

import (
	"encoding/json"
	"io"
	"meshgpu/wire"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestWriteErrorKeepsParamAndCode(t *testing.T) {
	rec := httptest.NewRecorder()
	wire.WriteError(rec, ModelNotFound("nope"))
	if rec.Code != 404 || rec.Header().Get("Content-Type") != "application/json" {
		t.Fatalf("status %d type %q", rec.Code, rec.Header().Get("Content-Type"))
	}
	var body map[string]map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatal(err)
	}
	e := body["error"]
	if e["param"] != "model" || e["code"] != "model_not_found" || e["type"] != wire.TypeInvalidRequest || !strings.Contains(e["message"].(string), "nope") {
		t.Fatalf("error body %s", rec.Body)
	}
	got, ok := wire.DecodeError(404, rec.Body.Bytes())
	if !ok || got.Param != "model" || got.Status != 404 {
		t.Fatalf("DecodeError: %+v %v", got, ok)
	}
	if _, ok := wire.DecodeError(502, []byte("<html>bad gateway</html>")); ok {
		t.Fatal("an HTML body decoded as an error")
	}
}

func TestSSEReaderJoinsDataLines(t *testing.T) {
	in := ": keep-alive comment\n" +
		"event: message\ndata: {\"a\":\ndata:1}\nid: 7\n\n" +
		"\n\n" +
		"data: second\r\n\r\n" +
		"data: [DONE]" // no blank line at the end
	r := NewSSEReader(strings.NewReader(in), 0)
	var got []string
	for {
		d, err := r.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, d)
	}
	want := []string{"{\"a\":\n1}", "second", SSEDone}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("events %q, want %q", got, want)
	}
}

func TestSSEReaderBoundsEvents(t *testing.T) {
	// Many short data lines must not build an event past the limit.
	in := strings.Repeat("data: xxxxxxxx\n", 1000) + "\n"
	r := NewSSEReader(strings.NewReader(in), 1024)
	if _, err := r.Next(); err == nil || err == io.EOF {
		t.Fatalf("an event of 9000 bytes passed a 1024-byte limit: %v", err)
	}
}

func TestSSEWriterRoundTrip(t *testing.T) {
	rec := httptest.NewRecorder()
	w := &SSEWriter{W: rec}
	if err := w.Event(map[string]string{"text": "a\nb"}); err != nil {
		t.Fatal(err)
	}
	if err := w.Raw([]byte("x\ny")); err == nil {
		t.Fatal("Raw wrote data with a newline, which would split the event")
	}
	w.Done()
	if rec.Header().Get("Content-Type") != "text/event-stream" {
		t.Fatalf("content type %q", rec.Header().Get("Content-Type"))
	}
	r := NewSSEReader(rec.Body, 0)
	d, _ := r.Next()
	var v map[string]string
	if json.Unmarshal([]byte(d), &v) != nil || v["text"] != "a\nb" {
		t.Fatalf("first event %q", d)
	}
	if d, _ := r.Next(); d != SSEDone {
		t.Fatalf("last event %q", d)
	}
}

func TestParseRequest(t *testing.T) {
	cases := []struct {
		name  string
		chat  bool
		body  string
		param string // "" with ok: accepted
		ok    bool
	}{
		{"parts", true, `{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}`, "", true},
		{"image part", true, `{"messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]}]}`, "messages[1].content[1].type", false},
		{"audio part", true, `{"messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{}}]}]}`, "messages[0].content[0].type", false},
		{"bad role", true, `{"messages":[{"role":"wizard","content":"x"}]}`, "messages[0].role", false},
		{"null content", true, `{"messages":[{"role":"user","content":null}]}`, "messages[0].content", false},
		{"messages string", true, `{"messages":"hi"}`, "messages", false},
		{"max_tokens 0", false, `{"prompt":"x","max_tokens":0}`, "max_tokens", false},
		{"max_completion_tokens 0", true, `{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":0}`, "max_completion_tokens", false},
		{"max_tokens string", false, `{"prompt":"x","max_tokens":"9"}`, "max_tokens", false},
		{"n", false, `{"prompt":"x","n":4}`, "", true},
		{"n too many", false, `{"prompt":"x","n":17}`, "n", false},
		{"batched", false, `{"prompt":["a","b"]}`, "", true},
		{"batched ids", false, `{"prompt":[[1,2],[3]]}`, "", true},
		{"empty prompt in batch", false, `{"prompt":["a",""]}`, "prompt", false},
		{"echo", false, `{"prompt":"x","echo":true}`, "", true},
		{"echo logprobs", false, `{"prompt":"x","echo":true,"logprobs":2}`, "logprobs", false},
		{"completions logprobs", false, `{"prompt":"x","logprobs":3}`, "", true},
		{"completions logprobs bool", false, `{"prompt":"x","logprobs":true}`, "logprobs", false},
		{"chat logprobs", true, `{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":5}`, "", true},
		{"top_logprobs without logprobs", true, `{"messages":[{"role":"user","content":"x"}],"top_logprobs":5}`, "top_logprobs", false},
		{"top_logprobs 21", true, `{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21}`, "top_logprobs", false},
		{"presence", false, `{"prompt":"x","presence_penalty":2.5}`, "presence_penalty", false},
		{"frequency", false, `{"prompt":"x","frequency_penalty":-1.5}`, "", true},
		{"best_of", false, `{"prompt":"x","best_of":3}`, "best_of", false},
		{"suffix", false, `{"prompt":"x","suffix":"y"}`, "suffix", false},
		{"logit_bias", false, `{"prompt":"x","logit_bias":{"1":5}}`, "logit_bias", false},
		{"stream_options no stream", false, `{"prompt":"x","stream_options":{"include_usage":true}}`, "stream_options", false},
		{"format type", true, `{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"yaml"}}`, "response_format.type", false},
		{"schema missing", true, `{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema","json_schema":{"name":"a"}}}`, "response_format.json_schema.schema", false},
		{"tool type", true, `{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"code"}]}`, "tools[0].type", false},
		{"tool_choice unknown", true, `{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":{"type":"function","function":{"name":"g"}}}`, "tool_choice", false},
		{"trailing data", false, `{"prompt":"x"} {}`, "", false},
		{"not json", false, `nope`, "", false},
		{"temperature", false, `{"prompt":"x","temperature":-1}`, "temperature", false},
	}
	for _, tc := range cases {
		req, e := ParseRequest([]byte(tc.body), tc.chat)
		if tc.ok {
			if e != nil {
				t.Errorf("%s: refused: %v (param %q)", tc.name, e, e.Param)
			}
			_ = req
			continue
		}
		if e == nil {
			t.Errorf("%s: accepted", tc.name)
			continue
		}
		if e.Status != 400 || e.Param != tc.param || e.Message == "" {
			t.Errorf("%s: %d param %q (%s), want 400 param %q", tc.name, e.Status, e.Param, e.Message, tc.param)
		}
	}
}

func TestContentPartsJoinAsText(t *testing.T) {
	req, e := ParseRequest([]byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"Hello"},{"type":"text","text":"world"}]},{"role":"assistant","content":"hi"}]}`), true)
	if e != nil {
		t.Fatal(e)
	}
	if req.Texts[0] != "Hello\nworld" || req.Texts[1] != "hi" {
		t.Fatalf("texts %q", req.Texts)
	}
	one, _ := ParseRequest([]byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"Hello"}]}]}`), true)
	str, _ := ParseRequest([]byte(`{"messages":[{"role":"user","content":"Hello"}]}`), true)
	if one.Texts[0] != str.Texts[0] {
		t.Fatalf("one text part %q differs from the string %q", one.Texts[0], str.Texts[0])
	}
}

func TestRequestIDAndIDs(t *testing.T) {
	r := httptest.NewRequest("POST", "/", nil)
	r.Header.Set(HeaderRequestID, "client-42")
	if RequestID(r) != "client-42" {
		t.Fatal("client's id not kept")
	}
	r.Header.Set(HeaderRequestID, "bad id\n")
	if id := RequestID(r); id == "bad id\n" || !strings.HasPrefix(id, "req-") {
		t.Fatalf("unusable id kept: %q", id)
	}
	seen := map[string]bool{}
	for i := 0; i < 1000; i++ {
		id := NewID("chatcmpl-")
		if seen[id] || len(id) != len("chatcmpl-")+24 {
			t.Fatalf("id %q repeated or malformed", id)
		}
		seen[id] = true
	}
}
