package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"

	"meshgpu/hopmux"
	"meshgpu/wire"
)

type tresult struct {
	resp   hopmux.TunnelResponse
	err    error
	stream *streamBody // set for a streamed answer (ResponseStart)
}

func (t *tconn) takeStream(id uint64) *streamBody {
	t.mu.Lock()
	defer t.mu.Unlock()
	sb := t.streams[id]
	delete(t.streams, id)
	return sb
}

func (t *tconn) deliver(id uint64, r tresult) {
	t.mu.Lock()
	ch := t.waiting[id]
	delete(t.waiting, id)
	t.mu.Unlock()
	if ch != nil {
		ch <- r // buffered 1
	}
}

// serve runs a relayed request through the handler in its own goroutine,
// up to maxInflight at once; beyond that it answers 429 at once.
func (t *tconn) serve(q hopmux.TunnelRequest) {
	if t.o.handler == nil {
		t.c.send(errFrame(q.ID, http.StatusNotImplemented, "this connection does not serve requests"))
		return
	}
	handler, sem := t.o.handler, t.sem
	if q.Path == wire.HopSealPath {
		if t.o.hops == nil || q.Method != http.MethodPost || q.Peer == "" {
			t.c.send(errFrame(q.ID, http.StatusNotImplemented, "this connection does not serve hop frames"))
			return
		}
		// Hellos have slots of their own: replayed ones take no request's.
		handler, sem = t.serveSeal(q.Peer), t.sealSem
	}
	select {
	case sem <- struct{}{}:
	default:
		t.c.send(errFrame(q.ID, http.StatusTooManyRequests, fmt.Sprintf("node busy: %d requests in flight", cap(sem))))
		return
	}
	ctx, cancel := context.WithTimeout(t.ctx, t.o.reqTimeout)
	t.mu.Lock()
	t.serving[q.ID] = cancel
	t.mu.Unlock()
	wanted := func() bool {
		t.mu.Lock()
		defer t.mu.Unlock()
		_, ok := t.serving[q.ID]
		return ok
	}
	// A handler that flushes (SSE) streams: ResponseStart with what it wrote
	// so far, ResponseData per later flush, ResponseEnd when it returns.
	onFlush := func(r *recorder) {
		if !wanted() || r.broken != "" {
			return
		}
		data := r.body.Bytes()
		r.body = bytes.Buffer{} // the queued message owns the old bytes
		if !r.started {
			a := hopmux.TunnelResponse{ID: q.ID, Status: uint16(r.status), Header: r.header, Body: data}
			head, err := a.AppendHeadAs(nil, hopmux.FrameResponseStart)
			if err != nil {
				r.broken = "response not encodable: " + err.Error()
				return
			}
			r.started = true
			if !t.fits(head, data) {
				r.broken = t.tooLarge("streamed response chunk", head, data)
				return
			}
			t.c.send(outMsg{head: head, body: data})
		} else if len(data) > 0 {
			head := hopmux.DataHead(q.ID, len(data))
			if !t.fits(head, data) {
				r.broken = t.tooLarge("streamed response chunk", head, data)
				return
			}
			t.c.send(outMsg{head: head, body: data})
		}
	}
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		defer func() { <-sem }()
		defer cancel()
		rec := serveLocal(ctx, handler, q.Method, q.Path, q.Header, q.Body, "relay:"+q.Peer, t.o.maxFrame, t.o.log, onFlush)
		if !wanted() {
			return // cancelled: the relay no longer waits for it
		}
		t.mu.Lock()
		delete(t.serving, q.ID)
		t.mu.Unlock()
		if rec.started {
			if rec.broken != "" {
				t.c.send(errFrame(q.ID, http.StatusBadGateway, rec.broken))
				return
			}
			if data := rec.body.Bytes(); len(data) > 0 {
				head := hopmux.DataHead(q.ID, len(data))
				if !t.fits(head, data) {
					t.c.send(errFrame(q.ID, http.StatusBadGateway, t.tooLarge("streamed response chunk", head, data)))
					return
				}
				t.c.send(outMsg{head: head, body: data})
			}
			t.c.send(outMsg{head: hopmux.Frame(hopmux.FrameResponseEnd, hopmux.AppendID(nil, q.ID))})
			return
		}
		a := hopmux.TunnelResponse{ID: q.ID, Status: uint16(rec.status), Header: rec.header, Body: rec.body.Bytes()}
		head, err := a.AppendHead(nil)
		if err != nil {
			t.c.send(errFrame(q.ID, http.StatusBadGateway, "response not encodable: "+err.Error()))
			return
		}
		if !t.fits(head, a.Body) {
			t.c.send(errFrame(q.ID, http.StatusBadGateway, t.tooLarge("response", head, a.Body)))
			return
		}
		t.c.send(outMsg{head: head, body: a.Body})
	}()
}

// roundTrip sends one request and waits for its answer or ctx.
// A streamed answer comes back with its head in Resp and the body in the
// returned streamBody.
func (t *tconn) roundTrip(ctx context.Context, peer, method, path string, h http.Header, body []byte) (hopmux.TunnelResponse, *streamBody, error) {
	t.mu.Lock()
	if t.dead != nil {
		t.mu.Unlock()
		return hopmux.TunnelResponse{}, nil, fmt.Errorf("%w: %v", errRelayLost, t.dead)
	}
	id := t.mux.NewID()
	ch := make(chan tresult, 1)
	t.waiting[id] = ch
	t.mu.Unlock()
	forget := func() {
		t.mu.Lock()
		delete(t.waiting, id)
		t.mu.Unlock()
	}
	q := hopmux.TunnelRequest{ID: id, Peer: peer, Method: method, Path: path, Header: h, Body: body}
	head, err := q.AppendHead(nil)
	if err != nil {
		forget()
		return hopmux.TunnelResponse{}, nil, err
	}
	if !t.fits(head, body) {
		forget()
		return hopmux.TunnelResponse{}, nil, errors.New("relay: " + t.tooLarge("hop", head, body))
	}
	if !t.c.send(outMsg{head: head, body: body}) {
		forget()
		return hopmux.TunnelResponse{}, nil, fmt.Errorf("%w: %v", errRelayLost, t.c.cause())
	}
	select {
	case r := <-ch:
		if r.stream != nil {
			r.stream.watch(ctx)
		}
		return r.resp, r.stream, r.err
	case <-ctx.Done():
		t.mu.Lock()
		_, still := t.waiting[id]
		delete(t.waiting, id)
		t.mu.Unlock()
		if !still {
			// Whoever took the waiter is handing over an answer; a streamed
			// one is registered on the tunnel and must be ended here.
			if r := <-ch; r.stream != nil {
				r.stream.abort(ctx.Err())
			}
		}
		t.c.send(outMsg{head: hopmux.Frame(hopmux.FrameCancel, hopmux.AppendID(nil, id))})
		return hopmux.TunnelResponse{}, nil, ctx.Err()
	}
}

// streamBody is the Body of a streamed answer: frames are queued by the
// read loop (never blocking it) and read by the caller. Unread data beyond
// limit, the caller's Close or its context ending cancel the request.
type streamBody struct {
	t     *tconn
	id    uint64
	limit int

	mu     sync.Mutex
	cond   *sync.Cond
	chunks [][]byte
	size   int
	err    error // io.EOF after ResponseEnd
	closed bool
	stop   func() bool
}

func newStreamBody(t *tconn, id uint64, limit int) *streamBody {
	sb := &streamBody{t: t, id: id, limit: limit}
	sb.cond = sync.NewCond(&sb.mu)
	return sb
}

func (b *streamBody) watch(ctx context.Context) {
	stop := context.AfterFunc(ctx, func() { b.abort(ctx.Err()) })
	b.mu.Lock()
	b.stop = stop
	b.mu.Unlock()
}

func (b *streamBody) push(p []byte) {
	if len(p) == 0 {
		return
	}
	b.mu.Lock()
	if b.err != nil || b.closed {
		b.mu.Unlock()
		return
	}
	if b.size+len(p) > b.limit {
		b.mu.Unlock()
		b.abort(errors.New("relay: streamed answer not read fast enough"))
		return
	}
	b.chunks = append(b.chunks, p)
	b.size += len(p)
	b.cond.Broadcast()
	b.mu.Unlock()
}

// finish ends the stream: nil for a complete answer.
func (b *streamBody) finish(err error) {
	if err == nil {
		err = io.EOF
	}
	b.mu.Lock()
	if b.err == nil {
		b.err = err
	}
	stop := b.stop
	b.cond.Broadcast()
	b.mu.Unlock()
	if stop != nil {
		stop()
	}
}

// abort ends the stream early and tells the other side.
func (b *streamBody) abort(err error) {
	if b.t.takeStream(b.id) != nil {
		b.t.c.send(outMsg{head: hopmux.Frame(hopmux.FrameCancel, hopmux.AppendID(nil, b.id))})
	}
	b.finish(err)
}

func (b *streamBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for len(b.chunks) == 0 && b.err == nil && !b.closed {
		b.cond.Wait()
	}
	if b.closed {
		return 0, errors.New("relay: read on a closed body")
	}
	if len(b.chunks) > 0 {
		n := copy(p, b.chunks[0])
		if b.chunks[0] = b.chunks[0][n:]; len(b.chunks[0]) == 0 {
			b.chunks = b.chunks[1:]
		}
		b.size -= n
		return n, nil
	}
	return 0, b.err
}

func (b *streamBody) Close() error {
	b.mu.Lock()
	done := b.err != nil
	b.closed = true
	b.cond.Broadcast()
	b.mu.Unlock()
	if !done {
		b.abort(errors.New("body closed"))
	}
	return nil
}

// recorder is the in-process http.ResponseWriter for relayed requests.
type recorder struct {
	header      http.Header
	status      int
	wroteHeader bool
	body        bytes.Buffer
	limit       int
	overflow    bool
	onFlush     func(*recorder) // nil: Flush does nothing, the answer goes whole
	started     bool            // a streamed answer's head has been sent
	broken      string          // why a started stream must end in an Error
}

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(code int) {
	if r.wroteHeader || code < 200 || code > 999 {
		return // informational and repeated headers are not relayed
	}
	r.status, r.wroteHeader = code, true
}

func (r *recorder) Write(p []byte) (int, error) {
	if !r.wroteHeader {
		r.WriteHeader(http.StatusOK)
	}
	if r.body.Len()+len(p) > r.limit {
		r.overflow = true
		if r.started {
			r.broken = "response chunk exceeds the maximum frame size"
		}
		return 0, errors.New("relay: response exceeds the maximum frame size")
	}
	return r.body.Write(p)
}

// Flush sends what the handler wrote so far when the connection streams
// (tunnel); on /ws the answer is sent whole at the end.
func (r *recorder) Flush() {
	if r.onFlush == nil {
		return
	}
	if !r.wroteHeader {
		r.WriteHeader(http.StatusOK)
	}
	r.onFlush(r)
}

// serveLocal calls h in-process, as direct HTTP would, and records the answer.
func serveLocal(ctx context.Context, h http.Handler, method, path string, header http.Header, body []byte, remote string, limit int, log *slog.Logger, onFlush func(*recorder)) (rec *recorder) {
	rec = &recorder{header: http.Header{}, limit: limit, onFlush: onFlush}
	fail := func(code int, typ, msg string) *recorder {
		if rec.started {
			rec.broken = msg
			return rec
		}
		r := &recorder{header: http.Header{"Content-Type": {"application/json"}}, limit: limit, status: code, wroteHeader: true}
		json.NewEncoder(&r.body).Encode(errorBody(typ, msg, ""))
		return r
	}
	if path == "" || path[0] != '/' {
		return fail(http.StatusBadRequest, "bad_request", "relayed request path must start with /")
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://relay"+path, bytes.NewReader(body))
	if err != nil {
		return fail(http.StatusBadRequest, "bad_request", "relayed request: "+err.Error())
	}
	if header == nil {
		header = http.Header{}
	}
	req.Header = header
	req.RequestURI = path
	req.RemoteAddr = remote
	req.ContentLength = int64(len(body))
	defer func() {
		if p := recover(); p != nil {
			if log != nil {
				log.Error("relayed request handler panicked", "path", path, "panic", p)
			}
			rec = fail(http.StatusInternalServerError, "internal_error", "handler failed")
		}
	}()
	h.ServeHTTP(rec, req)
	if rec.overflow {
		return fail(http.StatusBadGateway, "response_too_large", "response exceeds the relay's maximum frame size")
	}
	if !rec.wroteHeader {
		rec.status = http.StatusOK
	}
	return rec
}
