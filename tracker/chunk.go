package tracker

import (
	"bytes"
	"encoding/json"
	"math"

	"meshgpu/openai"
)

// headChunk is what audits and dispute copies read of a head's SSE chunk
// (the proxy rewrites chunks for the client and keeps its own map).
type headChunk struct {
	Error   json.RawMessage `json:"error"`
	Choices []struct {
		Delta *struct {
			Content   *string         `json:"content"`
			ToolCalls json.RawMessage `json:"tool_calls"`
		} `json:"delta"`
		Text         *string         `json:"text"`
		Logprobs     json.RawMessage `json:"logprobs"`
		FinishReason *string         `json:"finish_reason"`
	} `json:"choices"`
	Meshgpu    *openai.ChunkMeshgpu `json:"meshgpu"`
	MeshgpuEnd *openai.ChunkMeshgpu `json:"meshgpu_end"`
}

// chunkItem is one chunk's part of the text a client reads: the token id
// (-1: none), the text, the tool-call delta and the finish reason.
type chunkItem struct {
	id      int
	content string
	tools   string
	finish  string
}

func (c *headChunk) item() (chunkItem, bool) {
	if len(c.Choices) == 0 {
		return chunkItem{}, false // usage only
	}
	it := chunkItem{id: -1}
	if c.Meshgpu != nil {
		it.id = int(c.Meshgpu.Token)
	}
	ch := c.Choices[0]
	switch {
	case ch.Delta != nil && ch.Delta.Content != nil:
		it.content = *ch.Delta.Content
	case ch.Text != nil:
		it.content = *ch.Text
	}
	if ch.Delta != nil && len(ch.Delta.ToolCalls) > 0 && string(ch.Delta.ToolCalls) != "null" {
		var calls any // re-encoded as the proxy encodes its copy, for comparison
		json.Unmarshal(ch.Delta.ToolCalls, &calls)
		b, _ := json.Marshal(calls)
		it.tools = string(b)
	}
	if ch.FinishReason != nil {
		it.finish = *ch.FinishReason
	}
	return it, true
}

// token is the chunk's streamed token as an audit reads it; ok false when
// the chunk streams none.
func (c *headChunk) token(chat bool) (auditToken, bool) {
	if c.Meshgpu == nil {
		return auditToken{}, false
	}
	it, _ := c.item()
	t := auditToken{id: int(c.Meshgpu.Token), content: it.content, logprob: math.NaN(), top: c.Meshgpu.Top}
	if len(c.Choices) > 0 && len(c.Choices[0].Logprobs) > 0 {
		dec := json.NewDecoder(bytes.NewReader(c.Choices[0].Logprobs))
		dec.UseNumber()
		var lp any
		if dec.Decode(&lp) == nil {
			t.text, t.logprob = chosenLogprob(chat, lp)
		}
	}
	return t, true
}

// end is the chunk's end-of-text step (meshgpu_end), if any.
func (c *headChunk) end() *auditToken {
	if c.MeshgpuEnd == nil {
		return nil
	}
	e := c.MeshgpuEnd
	return &auditToken{id: int(e.Token), eos: true, logprob: float64(e.Logprob), top: e.Top}
}
