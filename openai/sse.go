package openai

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"
)

// SSE is the streaming framing of the OpenAI API: events of "data: <json>"
// lines ended by a blank line, and a final "data: [DONE]".

// SSEDone is the data of the stream's last event.
const SSEDone = "[DONE]"

// SSEWriteTimeout bounds one event's write: a client that stops reading
// must not hold a generation (and its sessions on every node) forever.
const SSEWriteTimeout = 30 * time.Second

// SSEWriter writes server-sent events. The headers go with the first event,
// so a failure before it can still be a JSON error response.
type SSEWriter struct {
	W       http.ResponseWriter
	started bool
}

// Started reports whether the stream's headers went out.
func (e *SSEWriter) Started() bool { return e.started }

func (e *SSEWriter) begin() {
	if !e.started {
		h := e.W.Header()
		h.Set("Content-Type", "text/event-stream")
		h.Set("Cache-Control", "no-cache")
		h.Set("X-Accel-Buffering", "no")
		e.W.WriteHeader(http.StatusOK)
		e.started = true
	}
}

// Event writes v as one JSON data event and flushes it.
func (e *SSEWriter) Event(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return e.Raw(b)
}

// Raw writes one data event of b, which must hold no newline.
func (e *SSEWriter) Raw(b []byte) error {
	if bytes.ContainsAny(b, "\r\n") {
		return errors.New("sse: event data holds a newline")
	}
	e.begin()
	buf := make([]byte, 0, len(b)+8)
	buf = append(buf, "data: "...)
	buf = append(buf, b...)
	buf = append(buf, '\n', '\n')
	rc := http.NewResponseController(e.W)
	rc.SetWriteDeadline(time.Now().Add(SSEWriteTimeout)) // not every writer supports deadlines
	if _, err := e.W.Write(buf); err != nil {
		return err
	}
	return rc.Flush()
}

// Done writes the final [DONE] event.
func (e *SSEWriter) Done() error { return e.Raw([]byte(SSEDone)) }

// End clears the write deadline so the connection may serve more requests.
func (e *SSEWriter) End() {
	if e.started {
		http.NewResponseController(e.W).SetWriteDeadline(time.Time{})
	}
}

// SSEReader reads the data of server-sent events. Several data: lines of
// one event are joined with "\n" (the SSE specification); comments, event:,
// id: and retry: lines are skipped.
type SSEReader struct {
	sc   *bufio.Scanner
	max  int
	data []byte
}

// NewSSEReader reads events of at most maxEvent bytes from r (default 1 MiB).
func NewSSEReader(r io.Reader, maxEvent int) *SSEReader {
	if maxEvent <= 0 {
		maxEvent = 1 << 20
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxEvent)
	return &SSEReader{sc: sc, max: maxEvent}
}

// Next returns the next event's data. At the end of the stream it returns
// io.EOF (a last event not ended by a blank line still counts); a read
// error or an over-long line is returned as is.
func (r *SSEReader) Next() (string, error) {
	have := false
	r.data = r.data[:0]
	for r.sc.Scan() {
		line := r.sc.Bytes()
		if len(line) == 0 {
			if have {
				return string(r.data), nil
			}
			continue
		}
		field, value, _ := bytes.Cut(line, []byte(":"))
		if len(field) == 0 {
			continue // a comment
		}
		value = bytes.TrimPrefix(value, []byte(" "))
		if string(field) != "data" {
			continue
		}
		if have {
			r.data = append(r.data, '\n')
		}
		r.data = append(r.data, value...)
		have = true
		if len(r.data) > r.max {
			return "", fmt.Errorf("sse: event over %d bytes", r.max)
		}
	}
	if err := r.sc.Err(); err != nil {
		return "", err
	}
	if have {
		return string(r.data), nil
	}
	return "", io.EOF
}
