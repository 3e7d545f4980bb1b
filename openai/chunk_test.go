package openai

import (
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http/httptest"
	"strings"
	"testing"

	"meshgpu/wire"
)

// A stream written by SSEWriter reads back through ChunkReader with
// meshgpu's extensions and both logprobs shapes typed, and [DONE] is told
// apart from a stream that just stops.
func TestChunkReaderRoundTrip(t *testing.T) {
	rec := httptest.NewRecorder()
	w := &SSEWriter{W: rec}
	text, content, stop := "a", "b", FinishStop
	w.Event(Completion{ID: "cmpl-1", Object: Object(false, true), Choices: []Choice{{Text: &text,
		Logprobs: &CompletionLogprobs{Tokens: []string{"a"}, TokenLogprobs: []float64{-0.5}, TopLogprobs: []map[string]float64{{"a": -0.5, "c": -1}}, TextOffset: []int{0}}}},
		Meshgpu: &ChunkMeshgpu{Token: 7, Logprob: -0.5, Top: []wire.Candidate{{ID: 7, Logprob: -0.5}}}})
	w.Event(Completion{ID: "chatcmpl-1", Choices: []Choice{{Delta: &ChatMessage{Content: &content},
		Logprobs: &ChatLogprobs{Content: []TokenLogprob{{Token: "b", Logprob: -0.25, TopLogprobs: []TopLogprob{{Token: "b", Logprob: -0.25}, {Token: "d", Logprob: -2}}}}}, FinishReason: &stop}},
		Usage: &Usage{PromptTokens: 3, CompletionTokens: 2, TotalTokens: 5}, MeshgpuEnd: &ChunkMeshgpu{Token: 2, Logprob: -0.1}})
	w.Event(wire.ErrorBody{Error: &wire.Error{Message: "hop failed", Type: "upstream_error", Hop: "n2"}})
	w.Done()

	r := NewChunkReader(rec.Body, 0)
	c, err := r.Next()
	if err != nil || c.Meshgpu == nil || c.Meshgpu.Token != 7 || len(c.Meshgpu.Top) != 1 || *c.Choices[0].Text != "a" {
		t.Fatalf("first chunk %+v, %v", c, err)
	}
	if tx, lp := c.Choices[0].Logprobs.Chosen(false); tx != "a" || lp != -0.5 {
		t.Fatalf("completions logprob %q %v", tx, lp)
	}
	c, err = r.Next()
	if err != nil || c.MeshgpuEnd == nil || c.MeshgpuEnd.Token != 2 || c.Meshgpu != nil || c.Usage == nil || c.Usage.TotalTokens != 5 ||
		*c.Choices[0].Delta.Content != "b" || *c.Choices[0].FinishReason != FinishStop {
		t.Fatalf("second chunk %+v, %v", c, err)
	}
	lp := c.Choices[0].Logprobs
	if tx, f := lp.Chosen(true); tx != "b" || f != -0.25 {
		t.Fatalf("chat logprob %q %v", tx, f)
	}
	// Written back in the chat shape only.
	b, _ := json.Marshal(lp.Shape(true))
	if string(b) != `{"content":[{"token":"b","logprob":-0.25,"bytes":null,"top_logprobs":[{"token":"b","logprob":-0.25,"bytes":null},{"token":"d","logprob":-2,"bytes":null}]}]}` {
		t.Fatalf("chat shape %s", b)
	}
	c, err = r.Next()
	if err != nil || c.Error == nil || c.Error.Hop != "n2" || c.Error.Message != "hop failed" {
		t.Fatalf("error event %+v, %v", c, err)
	}
	if _, err := r.Next(); err != io.EOF || !r.Done() {
		t.Fatalf("at [DONE]: %v, done %v", err, r.Done())
	}
	if _, err := r.Next(); err != io.EOF {
		t.Fatalf("after [DONE]: %v", err)
	}

	cut := NewChunkReader(strings.NewReader(`data: {"id":"x","choices":[]}`+"\n\n"), 0)
	if _, err := cut.Next(); err != nil {
		t.Fatal(err)
	}
	if _, err := cut.Next(); err != io.EOF || cut.Done() {
		t.Fatalf("a stream without [DONE]: %v, done %v", err, cut.Done())
	}
}

// Events that are not chunks are ErrBadChunk, never an empty chunk.
func TestChunkReaderRefusesNonChunks(t *testing.T) {
	for _, ev := range []string{`null`, `[1]`, `"x"`, `{"choices":"x"}`, `{"meshgpu":{"token":"7"}}`, `{"id":1}`, `{`} {
		r := NewChunkReader(strings.NewReader("data: "+ev+"\n\n"), 0)
		if c, err := r.Next(); !errors.Is(err, ErrBadChunk) {
			t.Errorf("%s: %+v, %v; want ErrBadChunk", ev, c, err)
		}
	}
}

func TestChunkLogprobsTrimAndAppend(t *testing.T) {
	chat := &ChunkLogprobs{ChatLogprobs: ChatLogprobs{Content: []TokenLogprob{{Token: "a", TopLogprobs: make([]TopLogprob, 5)}}}}
	chat.TrimTop(true, 2)
	if len(chat.Content[0].TopLogprobs) != 2 {
		t.Fatalf("chat top %d, want 2", len(chat.Content[0].TopLogprobs))
	}
	comp := &ChunkLogprobs{CompletionLogprobs: CompletionLogprobs{Tokens: []string{"a"}, TokenLogprobs: []float64{-1},
		TopLogprobs: []map[string]float64{{"a": -1, "b": -0.5, "c": -3, "d": -2}}}}
	comp.TrimTop(false, 2)
	if m := comp.TopLogprobs[0]; len(m) != 2 || m["a"] != -1 || m["b"] != -0.5 {
		t.Fatalf("completions top %v, want the two largest", m)
	}
	comp.Append(comp)
	if len(comp.Tokens) != 2 || len(comp.TopLogprobs) != 2 {
		t.Fatalf("appended %+v", comp.CompletionLogprobs)
	}
	var none *ChunkLogprobs
	if _, f := none.Chosen(true); !math.IsNaN(f) {
		t.Fatalf("no logprobs read as %v", f)
	}
}
