package relay

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"meshgpu/hopmux"
	"meshgpu/internal/boundmap"
	"meshgpu/wire"
)

// tconn is a node's end of a tunnel: it sends requests (roundTrip) and,
// with a handler, serves requests the relay routes to it.
type tconn struct {
	base   string
	c      *wsConn
	o      dialOpts
	sem    chan struct{}
	ctx    context.Context // cancelled when the connection ends
	cancel context.CancelFunc
	wg     sync.WaitGroup // writer, pinger and request goroutines
	done   chan struct{}  // closed when run returns
	// sendMax is the largest frame payload this end sends: the smaller of
	// its own limit and the relay's (ServerInfo), since the relay closes
	// the whole tunnel on a frame over its limit.
	sendMax int
	// ping is the keepalive period: the smaller of its own and the relay's
	// (ServerInfo), so the relay's idle timeout never drops a quiet tunnel.
	ping time.Duration
	// relayHops: the relay forwards Hop frames (ServerInfo features).
	relayHops bool
	// mux carries the hops both ways; the requests share its stream ids.
	mux hopmux.Conn
	// senders are the hop senders of this tunnel by the source peer id the
	// relay names (read loop only): a session bound by one takes unbound
	// hops only from it (wire.HopSender).
	senders boundmap.Map[string, *wire.HopSender]

	mu      sync.Mutex
	dead    error
	waiting map[uint64]chan tresult
	streams map[uint64]*streamBody        // streamed answers being received
	serving map[uint64]context.CancelFunc // requests being served

	// Keys of sealed hops (seal.go): sealOut by the peer this end sends
	// hops to, sealIn by the peer whose hops it serves. sealSem bounds the
	// key exchanges served at once, apart from the requests' sem.
	sealMu  sync.Mutex
	sealOut boundmap.Map[string, *sealSlot]
	sealIn  boundmap.Map[string, *peerSeal]
	sealSem chan struct{}
}

// writeFrame sends a frame for the mux: hops and their replies inline
// where the connection is free (sendNow), control frames queued.
func (t *tconn) writeFrame(head, body []byte, done func()) error {
	m := outMsg{head: head, body: body, done: done}
	ok := false
	if body == nil && done == nil {
		ok = t.c.send(m)
	} else {
		ok = t.c.sendNow(m)
	}
	if !ok {
		return fmt.Errorf("%w: %v", errRelayLost, t.c.cause())
	}
	return nil
}

// cancelRequest ends the request served for relay id id, if any.
func (t *tconn) cancelRequest(id uint64) {
	t.mu.Lock()
	cancel, ok := t.serving[id]
	delete(t.serving, id)
	t.mu.Unlock()
	if ok {
		cancel()
	}
}

// fits reports whether a frame of head (frame header included) and body
// is within the relay's limit.
func (t *tconn) fits(head, body []byte) bool {
	return len(head)-hopmux.FrameHeaderLen+len(body) <= t.sendMax
}

func (t *tconn) tooLarge(what string, head, body []byte) string {
	return fmt.Sprintf("%s of %d bytes exceeds the relay's maximum frame of %d bytes", what, len(head)-hopmux.FrameHeaderLen+len(body), t.sendMax)
}

// alive reports whether the connection can take new requests.
func (t *tconn) alive() bool {
	select {
	case <-t.c.closed:
		return false
	default:
		return true
	}
}

// run reads frames until the connection ends or ctx is done, then fails
// what is in flight and waits for the connection's goroutines.
func (t *tconn) run(ctx context.Context) error {
	defer close(t.done)
	stop := context.AfterFunc(ctx, func() { t.c.close(context.Canceled) })
	defer stop()
	t.wg.Add(2)
	go func() { defer t.wg.Done(); t.c.writeLoop() }()
	go func() { defer t.wg.Done(); keepalive(t.c, t.ping) }()
	t.wg.Add(1)
	go func() { defer t.wg.Done(); t.mux.Reap() }()
	err := t.shutdown(t.readLoop())
	t.wg.Wait()
	return err
}

// shutdown ends the tunnel once: closes the connection, cancels the hops
// and requests it serves, and fails the ones it sent. It returns why the
// tunnel ended (the first cause).
func (t *tconn) shutdown(err error) error {
	if c := t.c.cause(); c != nil {
		err = c
	}
	t.c.close(err)
	t.cancel()
	t.mu.Lock()
	if t.dead != nil {
		err = t.dead
		t.mu.Unlock()
		return err
	}
	t.dead = err
	waiting := t.waiting
	t.waiting = map[uint64]chan tresult{}
	streams := t.streams
	t.streams = map[uint64]*streamBody{}
	t.mu.Unlock()
	t.mux.Close(err)
	for _, ch := range waiting {
		ch <- tresult{err: fmt.Errorf("%w: %v", errRelayLost, err)}
	}
	for _, sb := range streams {
		sb.finish(fmt.Errorf("%w: %v", errRelayLost, err))
	}
	return err
}

// minPingInterval bounds how often a relay's advertisement makes a node ping.
const minPingInterval = 10 * time.Millisecond

// keepalive pings every interval; the peer's pongs (and any message)
// extend the read deadline, so a dead relay is noticed within 3 intervals.
func keepalive(c *wsConn, interval time.Duration) {
	tk := time.NewTicker(interval)
	defer tk.Stop()
	for {
		select {
		case <-c.closed:
			return
		case <-tk.C:
			if err := c.ping(interval); err != nil {
				c.close(fmt.Errorf("ping: %w", err))
				return
			}
		}
	}
}

func (t *tconn) readLoop() error {
	idle := 3 * t.ping
	if ws := t.c.ws; ws != nil {
		ws.SetPongHandler(func(string) error { ws.SetReadDeadline(time.Now().Add(idle)); return nil })
	}
	f := hopmux.Frames{Next: func() (io.Reader, error) { return t.c.frames(idle) },
		Messages: !t.c.endOfFrames(), Idle: idle, MaxFrame: t.o.maxFrame}
	if t.c.raw != nil {
		f.SetReadDeadline = t.c.raw.SetReadDeadline
	}
	// The mux reads every frame; hops run on the goroutine that read them
	// while another reads on; at most cap(t.sem) run, so one more can
	// always read.
	return t.mux.ServeFrames(f, t.readFrame, cap(t.sem)+1)
}

// readFrame reads one frame that is not a hop's (the mux takes those) of
// type typ and n bytes from r and acts on it: HTTP over the tunnel.
func (t *tconn) readFrame(r io.Reader, typ hopmux.FrameType, n int) error {
	if typ > hopmux.FrameHopReply {
		// A frame type this version does not know: skipped unread.
		return hopmux.Discard(r, n)
	}
	p, err := readPayload(r, n)
	if err != nil {
		return err
	}
	switch typ {
	case hopmux.FrameRequest:
		q, err := hopmux.ParseTunnelRequest(p)
		if err != nil {
			return fmt.Errorf("malformed Request frame: %w", err)
		}
		t.serve(q)
	case hopmux.FrameResponse:
		a, err := hopmux.ParseTunnelResponse(p)
		if err != nil {
			return fmt.Errorf("malformed Response frame: %w", err)
		}
		t.deliver(a.ID, tresult{resp: a})
	case hopmux.FrameError:
		e, err := hopmux.ParseTunnelError(p)
		if err != nil {
			return fmt.Errorf("malformed Error frame: %w", err)
		}
		re := &RelayError{Code: int(e.Code), Type: relayErrorType(int(e.Code)), Message: e.Message}
		if e.ID == 0 {
			return re
		}
		if w := t.mux.Take(e.ID); w != nil {
			var err error = re
			if e.Code == http.StatusUpgradeRequired || e.Code == http.StatusNotImplemented {
				err = fmt.Errorf("%w: %s", wire.ErrHopFramesUnsupported, e.Message)
			}
			w.Deliver(nil, err)
		} else if sb := t.takeStream(e.ID); sb != nil {
			sb.finish(re) // the stream broke after its head
		} else {
			t.deliver(e.ID, tresult{err: re})
		}
	case hopmux.FrameResponseStart:
		a, err := hopmux.ParseTunnelResponse(p)
		if err != nil {
			return fmt.Errorf("malformed ResponseStart frame: %w", err)
		}
		sb := newStreamBody(t, a.ID, t.o.maxFrame)
		sb.push(a.Body)
		t.mu.Lock()
		ch := t.waiting[a.ID]
		delete(t.waiting, a.ID)
		if ch != nil {
			t.streams[a.ID] = sb
		}
		t.mu.Unlock()
		if ch != nil {
			ch <- tresult{resp: a, stream: sb}
		}
	case hopmux.FrameResponseData:
		id, data, err := hopmux.ParseData(p)
		if err != nil {
			return fmt.Errorf("malformed ResponseData frame: %w", err)
		}
		t.mu.Lock()
		sb := t.streams[id]
		t.mu.Unlock()
		if sb != nil {
			sb.push(data)
		}
	case hopmux.FrameResponseEnd:
		if id, err := hopmux.ParseID(p); err == nil {
			if sb := t.takeStream(id); sb != nil {
				sb.finish(nil)
			}
		}
	}
	return nil
}

// readPayload reads a frame's payload of n bytes into a new slice.
func readPayload(r io.Reader, n int) ([]byte, error) {
	p := make([]byte, n)
	if _, err := io.ReadFull(r, p); err != nil {
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return nil, hopmux.ErrShortFrame
		}
		return nil, err
	}
	return p, nil
}

// maxHopSenders bounds a tunnel's senders; past it one is forgotten (its
// sessions answer 428 once and are bound again).
const maxHopSenders = 4096

// sender is the HopSender of the peer the relay names as a hop's source;
// a peer becomes one by sending a binding (a stranger's unbound hops add
// nothing). nil when the relay names no source: every hop then binds.
func (t *tconn) sender(peer string, binding bool) *wire.HopSender {
	if peer == "" {
		return nil
	}
	hs, _ := t.senders.Get(peer)
	if hs == nil && binding {
		hs = &wire.HopSender{Remote: "peer " + wire.Truncate(peer, 80) + " through the relay"}
		t.senders.Put(peer, hs)
	}
	return hs
}
