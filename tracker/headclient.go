package tracker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"

	"meshgpu/identity"
	"meshgpu/openai"
	"meshgpu/tracker/route"
	"meshgpu/wire"
)

// The tracker's one client of a head's OpenAI API: the proxy's attempts,
// the audits' referee sessions and the dispute copies all post through
// postToHead and read the answer as typed chunks (openai.ChunkReader,
// read here by itemOf, tokenOf and endOf), so a node cannot tell them apart
// and they read a stream alike.

// maxHeadEvent bounds one event of a head's stream.
const maxHeadEvent = 1 << 20

// postToHead posts body (an upstream request) to rt's head at path, with
// the rest of rt as its route, under a route ticket for rt: a route is the
// tracker's choice, and the head takes it only under the tracker's
// ticket. session and tk are the ticket's session id and the ticket (""
// when the head runs every layer).
func (s *Server) postToHead(ctx context.Context, rt route.Route, path string, body []byte) (resp *http.Response, session, tk string, err error) {
	head := rt.Hops[0]
	hops, _ := json.Marshal(rt.Hops[1:])
	var req *http.Request
	if head.Endpoint != "" {
		req, err = http.NewRequestWithContext(identity.WithPeerID(ctx, head.PeerID), http.MethodPost, strings.TrimSuffix(head.Endpoint, "/")+path, bytes.NewReader(body))
	} else {
		req, err = http.NewRequestWithContext(ctx, http.MethodPost, "http://relay.invalid"+path, bytes.NewReader(body))
	}
	if err != nil {
		return nil, "", "", err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "text/event-stream")
	req.Header.Set(wire.HeaderRoute, string(hops))
	if session, tk, err = s.setTicket(req.Header, rt); err != nil {
		return nil, "", "", err
	}
	req.Header.Set(wire.HeaderEndLayer, strconv.Itoa(head.EndLayer))
	switch {
	case head.Endpoint != "":
		resp, err = s.cfg.HTTPClient.Do(req)
	case s.cfg.Relay != nil && head.RelayAddr != "":
		resp, err = s.cfg.Relay.Do(ctx, head.RelayAddr, req)
	default:
		err = errors.New("head is relay-only and the tracker has no relay client")
	}
	return resp, session, tk, err
}

// headRefusal is a head's answer other than 200.
type headRefusal struct {
	status int
	err    *wire.Error // the error body; nil when the body is not one
	body   []byte      // its first 64 KiB
}

// readRefusal reads resp, an answer other than 200.
func readRefusal(resp *http.Response) headRefusal {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	r := headRefusal{status: resp.StatusCode, body: b}
	if e, ok := wire.DecodeError(resp.StatusCode, b); ok {
		r.err = e
	}
	return r
}

// named is the hop the error names, its type and message; an unknown
// body names nothing.
func (r headRefusal) named() (hop, typ, msg string) {
	if r.err == nil {
		s := strings.TrimSpace(string(r.body))
		if len(s) > 200 {
			s = s[:200]
		}
		return "", "", "unrecognized error body: " + s
	}
	return r.err.Hop, r.err.Type, r.err.Message
}

func (r headRefusal) Error() string {
	return fmt.Sprintf("HTTP %d: %s", r.status, bytes.TrimSpace(r.body[:min(len(r.body), 4<<10)]))
}

// eventError is a stream's error event (openai.Chunk.Error) as named
// reads it: hop, type and message, or nothing named without a message.
func eventError(e *wire.Error) (hop, typ, msg string) {
	if e.Message == "" {
		return "", "", "unrecognized error event"
	}
	return e.Hop, e.Type, e.Message
}

// chunkItem is one chunk's part of the text a client reads: the token id
// (-1: none), the text, the tool-call delta and the finish reason.
type chunkItem struct {
	id      int
	content string
	tools   string
	finish  string
}

// itemOf is c's first choice as a client reads it; false for a chunk
// without choices (usage only).
func itemOf(c *openai.Chunk, chat bool) (chunkItem, bool) {
	if len(c.Choices) == 0 {
		return chunkItem{}, false
	}
	it := chunkItem{id: -1}
	if c.Meshgpu != nil {
		it.id = int(c.Meshgpu.Token)
	}
	ch := c.Choices[0]
	switch {
	case chat && ch.Delta != nil:
		if ch.Delta.Content != nil {
			it.content = *ch.Delta.Content
		}
		if len(ch.Delta.ToolCalls) > 0 {
			b, _ := json.Marshal(ch.Delta.ToolCalls) // both replicas' deltas encoded alike, for comparison
			it.tools = string(b)
		}
	case !chat && ch.Text != nil:
		it.content = *ch.Text
	}
	if ch.FinishReason != nil {
		it.finish = *ch.FinishReason
	}
	return it, true
}

// tokenOf is the chunk's streamed token as an audit reads it; false when
// the chunk streams none.
func tokenOf(c *openai.Chunk, chat bool) (auditToken, bool) {
	if c.Meshgpu == nil {
		return auditToken{}, false
	}
	it, _ := itemOf(c, chat)
	t := auditToken{id: int(c.Meshgpu.Token), content: it.content, logprob: math.NaN(), top: c.Meshgpu.Top}
	if len(c.Choices) > 0 {
		t.text, t.logprob = c.Choices[0].Logprobs.Chosen(chat)
	}
	return t, true
}

// endOf is the chunk's end-of-text step (meshgpu_end), if any.
func endOf(c *openai.Chunk) *auditToken {
	e := c.MeshgpuEnd
	if e == nil {
		return nil
	}
	return &auditToken{id: int(e.Token), eos: true, logprob: float64(e.Logprob), top: e.Top}
}
