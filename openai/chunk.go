package openai

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
)

// Chunk is one streamed chunk of either endpoint as a reader decodes it
// (a writer sends Completion): its choices' logprobs typed in both shapes,
// meshgpu's extensions, and the error event of a failing stream.
type Chunk = CompletionOf[ChunkChoice]

// ChunkChoice is a chunk's choice: Text for completions, Delta for chat.
type ChunkChoice struct {
	Index        int            `json:"index"`
	Text         *string        `json:"text,omitempty"`
	Delta        *ChatMessage   `json:"delta,omitempty"`
	Logprobs     *ChunkLogprobs `json:"logprobs"`
	FinishReason *string        `json:"finish_reason"`
}

// ChunkLogprobs reads a choice's logprobs of either endpoint: chat fills
// ChatLogprobs, completions CompletionLogprobs (their fields do not
// overlap). A writer sends the one of its endpoint (Shape).
type ChunkLogprobs struct {
	ChatLogprobs
	CompletionLogprobs
}

// Shape is the logprobs in the shape of an endpoint's answer.
func (l *ChunkLogprobs) Shape(chat bool) any {
	if chat {
		return &l.ChatLogprobs
	}
	return &l.CompletionLogprobs
}

// Chosen is the streamed token's text and logprob (chat: content[0],
// completions: tokens[0]); NaN when the chunk names none.
func (l *ChunkLogprobs) Chosen(chat bool) (string, float64) {
	switch {
	case l == nil:
	case chat && len(l.Content) > 0:
		return l.Content[0].Token, l.Content[0].Logprob
	case !chat && len(l.Tokens) > 0 && len(l.TokenLogprobs) > 0:
		return l.Tokens[0], l.TokenLogprobs[0]
	}
	return "", math.NaN()
}

// TrimTop cuts the alternatives to n per token (chat: each entry's
// top_logprobs, most likely first; completions: each map keeps its n
// largest).
func (l *ChunkLogprobs) TrimTop(chat bool, n int) {
	if chat {
		for i := range l.Content {
			if e := &l.Content[i]; len(e.TopLogprobs) > n {
				e.TopLogprobs = e.TopLogprobs[:n]
			}
		}
		return
	}
	for _, alts := range l.TopLogprobs {
		for len(alts) > n {
			least, key := math.Inf(1), ""
			for k, v := range alts {
				if v < least || key == "" {
					least, key = v, k
				}
			}
			delete(alts, key)
		}
	}
}

// Append adds b's tokens after l's (a choice's logprobs over its chunks).
func (l *ChunkLogprobs) Append(b *ChunkLogprobs) {
	l.Content = append(l.Content, b.Content...)
	l.Tokens = append(l.Tokens, b.Tokens...)
	l.TokenLogprobs = append(l.TokenLogprobs, b.TokenLogprobs...)
	l.TopLogprobs = append(l.TopLogprobs, b.TopLogprobs...)
	l.TextOffset = append(l.TextOffset, b.TextOffset...)
}

// ErrBadChunk is a stream event that is not a chunk: not a JSON object,
// or one whose fields have the wrong types.
var ErrBadChunk = errors.New("the event is not a JSON object of a chunk's fields")

// ChunkReader reads the chunks of a stream (the one way meshgpu reads a
// head's or a tracker's stream).
type ChunkReader struct {
	sse  *SSEReader
	done bool
}

// NewChunkReader reads chunks of at most maxEvent bytes from r (default 1 MiB).
func NewChunkReader(r io.Reader, maxEvent int) *ChunkReader {
	return &ChunkReader{sse: NewSSEReader(r, maxEvent)}
}

// Next returns the next chunk. At [DONE] or at the end of the stream it
// returns io.EOF (Done says which); an event that is not a chunk is
// ErrBadChunk (wrapped, with the event's start), a read error as is.
func (r *ChunkReader) Next() (*Chunk, error) {
	if r.done {
		return nil, io.EOF
	}
	ev, err := r.sse.Next()
	if err != nil {
		return nil, err
	}
	if ev == SSEDone {
		r.done = true
		return nil, io.EOF
	}
	var c Chunk
	if t := strings.TrimLeft(ev, " \t\r\n"); t == "" || t[0] != '{' || json.Unmarshal([]byte(ev), &c) != nil {
		return nil, fmt.Errorf("%w: %.200s", ErrBadChunk, ev)
	}
	return &c, nil
}

// Done reports whether the stream ended with [DONE].
func (r *ChunkReader) Done() bool { return r.done }
