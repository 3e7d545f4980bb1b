package hopmux

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"

	"meshgpu/wire"
)

// Waiter is a hop sent and waiting for its reply. Waiters are pooled: one
// that saw its hop through is used again. The reader takes a waiter out
// of the Conn before it lends the waiter's buffer, so a sender giving up
// meanwhile waits for that reply rather than reuse a buffer being filled.
type Waiter struct {
	ch      chan result   // buffered 1
	written chan struct{} // buffered 1: the frame is written or dropped
	wrote   func()        // sends on written (made once, not per hop)
	into    ReplyBuffer
	buffer  func(uint64) ReplyBuffer // Buffer's (made once)
	// Head is scratch for the frame's head; Seal and Ctr are the
	// transport's (a sealed hop's keys, and the counter its reply names).
	Head []byte
	Seal any
	Ctr  uint64
}

type result struct {
	rep *wire.HopReply
	err error
}

var waiters = sync.Pool{New: func() any {
	w := &Waiter{ch: make(chan result, 1), written: make(chan struct{}, 1), Head: make([]byte, 0, 256)}
	w.wrote = func() { w.written <- struct{}{} }
	w.buffer = func(uint64) ReplyBuffer {
		if w.into != nil {
			return w.into
		}
		return HeapBuffer
	}
	return w
}}

// NewWaiter is a pooled waiter whose activations reply is read into the
// buffer into lends (nil: Go memory). Send returns it to the pool.
func NewWaiter(into ReplyBuffer) *Waiter {
	w := waiters.Get().(*Waiter)
	w.into = into
	return w
}

// Drop returns a waiter that was never sent.
func (w *Waiter) Drop() {
	w.into, w.Seal, w.Ctr = nil, nil, 0
	waiters.Put(w)
}

// Deliver hands w its reply or its failure.
func (w *Waiter) Deliver(rep *wire.HopReply, err error) { w.ch <- result{rep: rep, err: err} }

// Buffer is the ReplyBuffer a reply to w (nil: nobody waits) is read
// into; nil skips it unread.
func (w *Waiter) Buffer() func(uint64) ReplyBuffer {
	if w == nil {
		return noBuffer
	}
	return w.buffer
}

func noBuffer(uint64) ReplyBuffer { return nil }

// Take removes and returns the waiter of stream id, nil if none.
func (c *Conn) Take(id uint64) *Waiter {
	c.mu.Lock()
	defer c.mu.Unlock()
	w := c.waiting[id]
	delete(c.waiting, id)
	return w
}

// RoundTrip sends one plain hop to peer ("" on a direct connection) and
// waits for its reply or ctx.
func (c *Conn) RoundTrip(ctx context.Context, peer string, h *wire.HopHead, payload []byte, into ReplyBuffer) (*wire.HopReply, error) {
	return c.SendHop(ctx, NewWaiter(into), peer, h, payload)
}

// SendHop is RoundTrip with a waiter of the caller's: one whose Seal and
// Ctr are set is written by WriteSealed.
func (c *Conn) SendHop(ctx context.Context, w *Waiter, peer string, h *wire.HopHead, payload []byte) (*wire.HopReply, error) {
	head, err := AppendHopFrame(w.Head[:0], 0, peer, h, len(payload)) // stream id set by Send
	// A sealed frame's size is WriteSealed's to check.
	if err == nil && w.Seal == nil && c.MaxFrame > 0 && len(head)-FrameHeaderLen+len(payload) > c.MaxFrame {
		err = fmt.Errorf("hop of %d bytes exceeds the peer's maximum frame of %d bytes", len(head)-FrameHeaderLen+len(payload), c.MaxFrame)
	}
	if err != nil {
		w.Drop()
		return nil, err
	}
	w.Head = head
	return c.Send(ctx, w, head, payload)
}

// Send lists w, writes the Hop frame head (its stream id set here) and
// body, and waits for the reply or ctx. It returns only once body is no
// longer read, so the caller may reuse it; w goes back to the pool.
func (c *Conn) Send(ctx context.Context, w *Waiter, head, body []byte) (*wire.HopReply, error) {
	c.mu.Lock()
	if c.dead != nil {
		err := c.dead
		c.mu.Unlock()
		w.Drop()
		return nil, fmt.Errorf("%w: %v", c.Lost, err)
	}
	if c.MaxWaiting > 0 && len(c.waiting) >= c.MaxWaiting {
		c.mu.Unlock()
		w.Drop()
		return nil, fmt.Errorf("%d hops in flight to this peer", c.MaxWaiting)
	}
	c.next++
	id := c.next
	binary.BigEndian.PutUint64(head[FrameHeaderLen:], id)
	c.waiting[id] = w
	c.mu.Unlock()
	var err error
	if w.Seal != nil && c.WriteSealed != nil {
		err = c.WriteSealed(w, head, body, w.wrote)
	} else {
		err = c.Write(head, body, w.wrote)
	}
	if err != nil {
		c.Take(id)
		return nil, err // w not reused: written may yet be signalled
	}
	select {
	case r := <-w.ch:
		<-w.written
		w.Drop() // out of waiting, both channels drained
		return r.rep, r.err
	case <-ctx.Done():
		if c.Take(id) == nil {
			r := <-w.ch // the reader is handing the reply over
			r.rep.ReleaseBuffer()
		}
		c.Write(Frame(FrameCancel, AppendID(nil, id)), nil, nil)
		<-w.written
		w.Drop()
		return nil, ctx.Err()
	}
}

// readReply reads a HopReply of n bytes, activations into the buffer its
// waiter lends, and hands it over (the waiter is taken first).
func (c *Conn) readReply(r io.Reader, n int) error {
	var pre [11]byte // stream id u64 | status u16 | kind u8
	if n < len(pre) {
		return fmt.Errorf("malformed HopReply frame: %w", ErrShortFrame)
	}
	// A buffered stream is peeked at (no reader to put pre back in front).
	br, peek := r.(*bufio.Reader)
	if peek {
		p, err := br.Peek(len(pre))
		if err != nil {
			return err
		}
		copy(pre[:], p)
	} else if _, err := io.ReadFull(r, pre[:]); err != nil {
		return err
	}
	w := c.Take(binary.BigEndian.Uint64(pre[:]))
	if pre[10] == wire.ReplySealed && c.OpenReply != nil {
		if peek {
			br.Discard(len(pre))
		}
		return c.OpenReply(w, pre, r, n)
	}
	if !peek {
		r = io.MultiReader(bytes.NewReader(pre[:]), r)
	}
	_, rep, err := ReadHopReply(r, n, w.Buffer())
	if err != nil {
		err = fmt.Errorf("malformed HopReply frame: %w", err)
		if w != nil {
			w.Deliver(nil, fmt.Errorf("%w: %v", c.Lost, err))
		}
		return err
	}
	switch {
	case w == nil:
		rep.ReleaseBuffer() // late or unknown: dropped
	case c.CheckPlain != nil:
		if err := c.CheckPlain(w, rep); err != nil {
			rep.ReleaseBuffer()
			w.Deliver(nil, err)
			return nil
		}
		w.Deliver(rep, nil)
	default:
		w.Deliver(rep, nil)
	}
	return nil
}

// ErrClosed is a Conn's Lost when its transport names none.
var ErrClosed = errors.New("hop connection closed")
