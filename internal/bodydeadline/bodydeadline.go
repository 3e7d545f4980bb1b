// Package bodydeadline bounds how long a request body may take to arrive,
// so a client that trickles a byte every few seconds cannot hold a
// connection (and its handler goroutine) open: the read deadline of the
// connection is set when a request with a body starts and cleared once the
// body has been read, so responses that stream for longer (the tracker's
// proxy) are not cut. Header reads are bounded by the http.Server's
// ReadHeaderTimeout, which only the server can set.
package bodydeadline

import (
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"time"
)

// Default is the body deadline the tracker and the relay use when their
// configuration gives none (the node's hop deadline is the same 30 s).
const Default = 30 * time.Second

// ErrTimeout is what a body read returns after the deadline; a handler
// answers it with 408 (Status).
var ErrTimeout = errors.New("request body did not arrive within the deadline")

// Middleware gives every request with a body d to deliver it (Default
// when d <= 0). Requests without a body (GETs, WebSocket upgrades) are left
// alone: their connection outlives the request.
func Middleware(d time.Duration, next http.Handler) http.Handler {
	if d <= 0 {
		d = Default
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
			next.ServeHTTP(w, r)
			return
		}
		rc := http.NewResponseController(w)
		if err := rc.SetReadDeadline(time.Now().Add(d)); err != nil {
			// Not a connection that supports deadlines (HTTP/2 does,
			// per stream; a test recorder does not): nothing to bound.
			next.ServeHTTP(w, r)
			return
		}
		r.Body = &body{ReadCloser: r.Body, rc: rc}
		next.ServeHTTP(w, r)
	})
}

type body struct {
	io.ReadCloser
	rc   *http.ResponseController
	done bool
}

func (b *body) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if errors.Is(err, io.EOF) && !b.done {
		b.done = true
		// The whole body is in: from here on the connection may stay
		// quiet for as long as the response takes.
		_ = b.rc.SetReadDeadline(time.Time{})
	}
	var ne net.Error
	if err != nil && (errors.Is(err, os.ErrDeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()) {
		return n, ErrTimeout
	}
	return n, err
}

// Status is the HTTP status for a body read error: 408 for ErrTimeout,
// 413 otherwise (too large or unreadable).
func Status(err error) int {
	if errors.Is(err, ErrTimeout) {
		return http.StatusRequestTimeout
	}
	return http.StatusRequestEntityTooLarge
}
