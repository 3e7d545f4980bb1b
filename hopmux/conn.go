package hopmux

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"meshgpu/wire"
)

// Conn is the hop side of one frame stream: the hops it serves and the
// hops it sent and waits for. Set the fields, then call Start once; the
// transport runs ServeFrames (or Serve, or hands each frame to ReadFrame).
type Conn struct {
	// Write sends one frame from head and body (body is not copied) and
	// calls done, when set, once body is no longer read, sent or not. An
	// error means the frame did not go; the transport closes itself on a
	// partial write.
	Write func(head, body []byte, done func()) error
	// Handler serves Hop frames; nil refuses them (501).
	Handler Handler
	// Context, when set, is the parent of every served hop's context (a
	// direct connection puts its one wire.HopSender there).
	Context context.Context
	// Sender names a hop's sender for the handler (wire.HopSender) from
	// the peer id its route names ("" on direct connections) and whether
	// it carries a binding; nil: no sender.
	Sender func(peer string, binding bool) *wire.HopSender
	// Timeout, when set, ends a served hop's context that long after it
	// was read; Reap enforces it to within an eighth (a runtime timer
	// per hop costs more than its work on a tunnel). The head's deadline is
	// the handler's to keep (node.Server.runHop does).
	Timeout time.Duration
	// Slots, when set, bounds the hops served at once (shared with what
	// else the transport serves); past it a hop is answered 429.
	Slots chan struct{}
	// MaxFrame is the largest frame payload the peer takes (0: no check);
	// MaxWaiting bounds the hops sent and in flight (0: no bound).
	MaxFrame, MaxWaiting int
	// Lost wraps the cause for hops failed by the connection's end (nil:
	// ErrClosed).
	Lost error
	// Reply sends a served hop's reply frame; nil writes it with Write.
	Reply ReplyWriter
	// WriteSealed, when set, writes the Hop frames of waiters whose Seal
	// is set, in place of Write: head is the plain frame (stream id set)
	// but body, which the transport seals to w.Seal with counter w.Ctr
	// (both set before Send lists w, so a reply read for its stream finds
	// them) and sends; done as Write's.
	WriteSealed func(w *Waiter, head, body []byte, done func()) error
	// OpenHop, when set, serves a Hop frame after its route (sealed hops,
	// relay/endpoint_hop.go): it calls ServeHop with what it opened.
	OpenHop func(rt HopRoute, r io.Reader, rest int) (func(), error)
	// OpenReply, when set, reads a sealed HopReply (kind wire.ReplySealed)
	// for w (nil: nobody waits) after its first 11 bytes pre, and delivers
	// to a non-nil w on every path, errors included (w is already taken
	// from the table); CheckPlain, when set, vets a plain reply to w before
	// it is handed over.
	OpenReply  func(w *Waiter, pre [11]byte, r io.Reader, n int) error
	CheckPlain func(w *Waiter, rep *wire.HopReply) error
	// OnCancel gets a Cancel for a stream no hop of this Conn serves (a
	// tunnel's requests share the id space).
	OnCancel func(id uint64)
	// OnClose, when set, is called once by Close with its cause: the
	// transport closes itself.
	OnClose func(error)

	ctx     context.Context // ends with Close
	cancel  context.CancelFunc
	scratch []byte // hop heads; read side only

	mu      sync.Mutex
	dead    error
	next    uint64
	waiting map[uint64]*Waiter
	serving map[uint64]served
	served  uint64 // hops served so far: each one's seq
}

// served is a hop being served: cancel ends it; by, when set, is when
// Reap does.
type served struct {
	cancel context.CancelFunc
	by     time.Time
	// seq tells this hop from a later one that reuses its stream id after
	// a Cancel: the earlier one's end must not remove the later's entry.
	seq uint64
}

// Start readies c, once its fields are set.
func (c *Conn) Start() {
	parent := c.Context
	if parent == nil {
		parent = context.Background()
	}
	c.ctx, c.cancel = context.WithCancel(parent)
	if c.Lost == nil {
		c.Lost = ErrClosed
	}
	c.scratch = make([]byte, 4<<10)
	c.waiting = map[uint64]*Waiter{}
	c.serving = map[uint64]served{}
}

// NewID is a fresh stream id (hops and whatever else shares the stream).
func (c *Conn) NewID() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.next++
	return c.next
}

// Close ends c once: cancels the hops it serves and fails those waiting.
func (c *Conn) Close(err error) {
	c.cancel()
	c.mu.Lock()
	if c.dead != nil {
		c.mu.Unlock()
		return
	}
	c.dead = err
	waiting := c.waiting
	c.waiting = map[uint64]*Waiter{}
	c.mu.Unlock()
	if c.OnClose != nil {
		c.OnClose(err)
	}
	for _, w := range waiting {
		w.ch <- result{err: fmt.Errorf("%w: %v", c.Lost, err)}
	}
}

// Serve reads frames with next and dispatches them (ReadFrame; others is
// called for the frames it does not take, nil skips them), serving hops on
// the goroutine that read them while another reads on (serveFrames), at most
// limit at once. It returns next's error, once c is closed and its hops
// have returned.
func (c *Conn) Serve(next func() (FrameType, io.Reader, int, error), others func(io.Reader, FrameType, int) error, limit int) error {
	return serveFrames(func() (func(), error) {
		work, err := c.readNext(next, others)
		if err != nil {
			c.Close(err) // the hops in flight end with the connection
		}
		return work, err
	}, limit)
}

func (c *Conn) readNext(next func() (FrameType, io.Reader, int, error), others func(io.Reader, FrameType, int) error) (func(), error) {
	typ, r, n, err := next()
	if err != nil {
		return nil, err
	}
	work, ok, err := c.ReadFrame(r, typ, n)
	if ok || err != nil {
		return work, err
	}
	if others != nil {
		return nil, others(r, typ, n)
	}
	return nil, Discard(r, n) // a frame type this Conn does not use
}

// ReadFrame reads a hop frame of type typ and n bytes from r and acts on
// it: the one dispatch of hop frames. A Hop returns the work that serves
// it; ok is false, and nothing read, for a frame that is not a hop's.
func (c *Conn) ReadFrame(r io.Reader, typ FrameType, n int) (work func(), ok bool, err error) {
	switch typ {
	case FrameHop:
		if c.OpenHop == nil { // plain: route and head in one read
			rt, h, pl, err := ReadHop(r, n, c.scratch, 0) // the handler checks layers
			if err != nil {
				return nil, true, fmt.Errorf("malformed Hop frame: %w", err)
			}
			work, err = c.serveHead(rt, h, r, pl, nil)
			return work, true, err
		}
		rt, rest, err := ReadHopRoute(r, n)
		if err != nil {
			return nil, true, fmt.Errorf("malformed Hop frame: %w", err)
		}
		work, err = c.OpenHop(rt, r, rest)
		return work, true, err
	case FrameHopReply:
		return nil, true, c.readReply(r, n)
	case FrameCancel:
		var b [8]byte
		if n != len(b) {
			return nil, true, fmt.Errorf("malformed Cancel frame of %d bytes", n)
		}
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return nil, true, err
		}
		c.cancelStream(binary.BigEndian.Uint64(b[:]))
	case FramePing:
		if n != 8 {
			return nil, true, fmt.Errorf("malformed Ping frame of %d bytes", n)
		}
		p := make([]byte, 8)
		if _, err := io.ReadFull(r, p); err != nil {
			return nil, true, err
		}
		return nil, true, c.Write(Frame(FramePong, p), nil, nil)
	case FramePong:
		return nil, true, Discard(r, n)
	default:
		return nil, false, nil
	}
	return nil, true, nil
}

func (c *Conn) cancelStream(id uint64) {
	c.mu.Lock()
	sv, ok := c.serving[id]
	delete(c.serving, id)
	c.mu.Unlock()
	switch {
	case ok:
		sv.cancel()
	case c.OnCancel != nil:
		c.OnCancel(id)
	}
}

// ---- serving ----

// ServeHop serves the Hop whose head and payload (rest bytes) r reads:
// its payload goes straight into the buffer the handler lends, and the
// work returned runs it (nil when it was answered already). reply sends
// its reply frame (nil: c.Reply). A malformed head is an error (the stream's
// framing is lost) unless intact: the frame was read whole already (an
// opened sealed hop), so the hop is answered 400 instead.
func (c *Conn) ServeHop(rt HopRoute, r io.Reader, rest int, reply ReplyWriter, intact bool) (func(), error) {
	h, pl, err := ReadHopHead(r, rest, c.scratch, 0) // the handler checks layers
	if err != nil {
		if intact {
			c.Answer(rt.Stream, reply, ErrorReply(http.StatusBadRequest, "invalid_header", "malformed Hop head: "+err.Error()))
			return nil, nil
		}
		return nil, fmt.Errorf("malformed Hop frame: %w", err)
	}
	return c.serveHead(rt, h, r, pl, reply)
}

// serveHead is ServeHop once the head h is read: r reads the pl payload
// bytes that follow it.
func (c *Conn) serveHead(rt HopRoute, h *wire.HopHead, r io.Reader, pl int, reply ReplyWriter) (func(), error) {
	refuse := func(rep *wire.HopReply) (func(), error) {
		if err := Discard(r, pl); err != nil {
			return nil, err
		}
		c.Answer(rt.Stream, reply, rep)
		return nil, nil
	}
	if c.Handler == nil {
		return refuse(ErrorReply(http.StatusNotImplemented, "not_supported", "this connection does not serve hop frames"))
	}
	if int64(pl) != h.PayloadLen() {
		return refuse(ErrorReply(http.StatusBadRequest, "invalid_header", fmt.Sprintf("body is %d bytes but shape %d,%d needs %d", pl, h.NTokens, h.Hidden, h.PayloadLen())))
	}
	c.mu.Lock()
	_, dup := c.serving[rt.Stream]
	c.mu.Unlock()
	if dup {
		return refuse(ErrorReply(http.StatusBadRequest, "invalid_header", "stream id already in flight"))
	}
	if c.Slots != nil {
		select {
		case c.Slots <- struct{}{}:
		default:
			return refuse(ErrorReply(http.StatusTooManyRequests, wire.TypeOverloaded, fmt.Sprintf("node busy: %d requests in flight", cap(c.Slots))))
		}
	}
	// Cancelled by a Cancel frame, the connection's end, or Reap.
	ctx, cancel := context.WithCancel(c.ctx)
	if c.Sender != nil {
		if hs := c.Sender(rt.Peer, h.Binding != nil); hs != nil {
			ctx = wire.WithHopSender(ctx, hs)
		}
	}
	hop := c.Handler.AcceptHop(ctx, h)
	if rep := Refused(hop); rep != nil {
		c.done(cancel)
		return refuse(rep)
	}
	if _, err := io.ReadFull(r, hop.Payload()); err != nil {
		hop.Serve(ctx, false)
		c.done(cancel)
		return nil, fmt.Errorf("reading a hop payload: %w", err)
	}
	sv := served{cancel: cancel}
	if c.Timeout > 0 {
		sv.by = time.Now().Add(c.Timeout)
	}
	c.mu.Lock()
	c.served++
	sv.seq = c.served
	c.serving[rt.Stream] = sv
	c.mu.Unlock()
	return func() {
		defer c.done(cancel)
		rep := hop.Serve(ctx, true)
		c.mu.Lock()
		cur, ok := c.serving[rt.Stream]
		wanted := ok && cur.seq == sv.seq
		if wanted {
			delete(c.serving, rt.Stream)
		}
		c.mu.Unlock()
		if !wanted || ctx.Err() != nil {
			rep.ReleaseBuffer() // cancelled: nobody waits for it
			return
		}
		c.Answer(rt.Stream, reply, rep)
	}, nil
}

// done ends a served hop: its context and its slot.
func (c *Conn) done(cancel context.CancelFunc) {
	cancel()
	if c.Slots != nil {
		<-c.Slots
	}
}

// ReplyWriter sends the reply to a served hop: frame is its HopReply
// frame as the mux encoded it, but rep.Payload, which follows it; the
// writer releases rep's buffer once it is sent. A nil frame with err: rep
// does not encode (a field over its limit), and the writer answers the
// hop as its transport can.
type ReplyWriter func(stream uint64, frame []byte, rep *wire.HopReply, err error)

// Answer encodes rep, the reply to stream, and sends it with reply, else
// c.Reply, else plainly with Write (a reply that does not encode is
// dropped there: the sender's deadline ends its wait).
func (c *Conn) Answer(stream uint64, reply ReplyWriter, rep *wire.HopReply) {
	frame, err := AppendHopReplyFrame(make([]byte, 0, 64+len(rep.Body)), stream, rep)
	if reply == nil {
		reply = c.Reply
	}
	switch {
	case reply != nil:
		reply(stream, frame, rep, err)
	case err != nil:
		rep.ReleaseBuffer()
	default:
		c.Write(frame, rep.Payload, rep.ReleaseBuffer)
	}
}

// Reap cancels the hops served past Timeout until c closes; with no
// Timeout it returns at once. The transport runs it beside Serve.
func (c *Conn) Reap() {
	if c.Timeout <= 0 {
		return
	}
	tk := time.NewTicker(max(c.Timeout/8, time.Millisecond))
	defer tk.Stop()
	var late []context.CancelFunc
	for {
		select {
		case <-c.ctx.Done():
			return
		case now := <-tk.C:
			c.mu.Lock()
			for _, sv := range c.serving {
				if !sv.by.IsZero() && now.After(sv.by) {
					late = append(late, sv.cancel)
				}
			}
			c.mu.Unlock()
			for _, cancel := range late {
				cancel()
			}
			clear(late)
			late = late[:0]
		}
	}
}
