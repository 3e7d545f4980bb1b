package relay

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"meshgpu/hopmux"
	"meshgpu/wire"
)

// sealSlot holds the keys for one target, or the exchange making them.
type sealSlot struct {
	k *sealKeys
	x *sealExchange // in flight; nil when none
}

// sealExchange is one key exchange in flight: done closes when k or err
// is set. Hops to the same peer wait for it, each within its own context.
type sealExchange struct {
	done chan struct{}
	k    *sealKeys
	err  error
}

// peerSeal is what one peer seals its hops to this end with: cur, the
// keys a frame last opened under, and next, the newest exchange's, which
// replace cur once a frame opens under them. A hello carries nothing
// fresh (the relay can replay it), so it only ever replaces next: keys in
// use are never evicted by one.
type peerSeal struct {
	cur, next *sealKeys
	used      time.Time // when a frame last opened, or next was made
}

func (ps *peerSeal) keys(id [wire.SealKeyIDLen]byte) *sealKeys {
	switch {
	case ps.cur != nil && ps.cur.id == id:
		return ps.cur
	case ps.next != nil && ps.next.id == id:
		return ps.next
	}
	return nil
}

// A tunnel holds the keys of up to maxSealPeers peers each way. A peer's
// keys it serves go only once unused for sealIdle (sealPendingIdle when no
// frame ever opened under them: an honest sender uses them at once); when
// none may go, a new peer's hello is answered 429. Keys it sends with go
// any time (the next hop exchanges again).
const (
	maxSealPeers     = 1024
	sealIdle         = 2 * time.Minute
	sealPendingIdle  = 10 * time.Second
	maxSealExchanges = 4
)

func sealInEvictable(_ string, ps *peerSeal) bool {
	idle := time.Since(ps.used)
	return idle > sealIdle || ps.cur == nil && idle > sealPendingIdle
}

// openHop serves a Hop frame after its route (rest bytes of r) for the
// mux: a sealed one opened with the keys its sender exchanged (seal.go),
// a plain one as it is, unless its sender seals.
func (t *tconn) openHop(rt hopmux.HopRoute, r io.Reader, rest int) (func(), error) {
	var lb [4]byte
	if rest < len(lb) {
		return nil, fmt.Errorf("malformed Hop frame: %w", hopmux.ErrShortFrame)
	}
	if _, err := io.ReadFull(r, lb[:]); err != nil {
		return nil, err
	}
	if binary.BigEndian.Uint32(lb[:]) != wire.SealedHopMark {
		t.sealMu.Lock()
		_, sealing := t.sealIn.Get(rt.Peer)
		t.sealMu.Unlock()
		if sealing {
			// This peer seals its hops: a plain one in its name is the
			// relay's own.
			if err := hopmux.Discard(r, rest-len(lb)); err != nil {
				return nil, err
			}
			t.mux.Answer(rt.Stream, nil, hopmux.ErrorReply(http.StatusForbidden, "seal_required", "this peer seals its hops; a plain one in its name is refused"))
			return nil, nil
		}
		// A plain hop (a sender of an older version): it chose to be read.
		return t.mux.ServeHop(rt, io.MultiReader(bytes.NewReader(lb[:]), r), rest, nil, false)
	}
	var sp [wire.SealPrefixLen]byte
	clen := rest - len(lb) - len(sp)
	if clen < wire.SealOverhead {
		return nil, fmt.Errorf("malformed sealed Hop frame: %w", hopmux.ErrShortFrame)
	}
	if _, err := io.ReadFull(r, sp[:]); err != nil {
		return nil, err
	}
	ctr := binary.BigEndian.Uint64(sp[wire.SealKeyIDLen:])
	t.sealMu.Lock()
	var k *sealKeys
	ps, _ := t.sealIn.Get(rt.Peer)
	if ps != nil {
		k = ps.keys([wire.SealKeyIDLen]byte(sp[:wire.SealKeyIDLen]))
	}
	t.sealMu.Unlock()
	if k == nil || k.peer != rt.Peer {
		if err := hopmux.Discard(r, clen); err != nil {
			return nil, err
		}
		t.mux.Answer(rt.Stream, nil, hopmux.ErrorReply(http.StatusUnauthorized, wire.TypeSealUnknown, "unknown hop key: exchange keys again"))
		return nil, nil
	}
	buf := sealBuf(clen)
	defer putSealBuf(buf) // the head is parsed and the payload copied before ServeHop returns
	if _, err := io.ReadFull(r, *buf); err != nil {
		return nil, err
	}
	plain, err := k.open(ctr, *buf)
	if err != nil {
		// Unsealed: the frame did not authenticate, so neither its counter
		// nor its stream is the sender's, and a reply sealed to them would
		// be one the relay could pass off as the answer to a real hop.
		t.mux.Answer(rt.Stream, nil, hopmux.ErrorReply(http.StatusBadRequest, "bad_seal", err.Error()))
		return nil, nil
	}
	t.sealMu.Lock()
	if ps.next == k {
		ps.cur, ps.next = k, nil
	}
	ps.used = time.Now()
	t.sealMu.Unlock()
	reply := func(stream uint64, frame []byte, rep *wire.HopReply, err error) {
		t.sendSealedHopReply(stream, k, ctr, frame, rep, err)
	}
	return t.mux.ServeHop(rt, bytes.NewReader(plain), len(plain), reply, true)
}

// sendSealedHopReply queues the reply frame head (the mux's, plain; err:
// rep did not encode) and rep's payload sealed with k, naming the hop's
// counter ctr; rep's buffer is released once copied into the sealed one.
func (t *tconn) sendSealedHopReply(stream uint64, k *sealKeys, ctr uint64, head []byte, rep *wire.HopReply, err error) {
	if err != nil {
		rep.ReleaseBuffer()
		t.c.send(errFrame(stream, http.StatusBadGateway, err.Error()))
		return
	}
	const pre = hopmux.FrameHeaderLen + 8 // frame header and stream id
	plain := 8 + len(head) - pre + len(rep.Payload)
	buf := sealBuf(plain + wire.SealOverhead)
	binary.BigEndian.PutUint64(*buf, ctr)
	copy((*buf)[8+copy((*buf)[8:], head[pre:]):], rep.Payload)
	rep.ReleaseBuffer()
	c, body := k.seal(*buf, plain)
	*buf = body
	head = binary.BigEndian.AppendUint16(head[:pre], 0)
	head = append(head, wire.ReplySealed)
	head = append(head, k.id[:]...)
	head = binary.BigEndian.AppendUint64(head, c)
	binary.BigEndian.PutUint32(head[1:], uint32(len(head)-hopmux.FrameHeaderLen+len(body)))
	if !t.fits(head, body) {
		putSealBuf(buf)
		t.c.send(errFrame(stream, http.StatusBadGateway, t.tooLarge("hop reply", head, body)))
		return
	}
	t.c.sendNow(outMsg{head: head, body: body, done: func() { putSealBuf(buf) }})
}

// serveSeal answers a hop key exchange from peer (seal.go) and keeps the
// keys for the hops it will send.
func (t *tconn) serveSeal(peer string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hello, err := io.ReadAll(io.LimitReader(r.Body, 1<<10))
		if err != nil {
			return
		}
		accept, k, err := acceptSeal(t.o.id, peer, hello)
		if err != nil {
			writeHTTPError(w, http.StatusForbidden, "seal_refused", err.Error())
			return
		}
		t.sealMu.Lock()
		ps, ok := t.sealIn.Get(peer)
		if ok {
			ps.next = k // one exchange per peer pending; cur stays until k opens a frame
			if ps.cur == nil {
				ps.used = time.Now()
			}
		} else {
			ok = t.sealIn.Put(peer, &peerSeal{next: k, used: time.Now()})
		}
		t.sealMu.Unlock()
		if !ok {
			writeHTTPError(w, http.StatusTooManyRequests, wire.TypeOverloaded,
				fmt.Sprintf("this node holds the hop keys of %d peers, all in use", maxSealPeers))
			return
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Write(accept)
	})
}

// sendHopReply queues the mux's HopReply frame head (err: rep did not
// encode) and rep's payload from its own buffer, released once written.
func (t *tconn) sendHopReply(stream uint64, head []byte, rep *wire.HopReply, err error) {
	if err == nil && !t.fits(head, rep.Payload) {
		err = errors.New(t.tooLarge("hop reply", head, rep.Payload))
	}
	if err != nil {
		rep.ReleaseBuffer()
		t.c.send(errFrame(stream, http.StatusBadGateway, err.Error()))
		return
	}
	t.c.sendNow(outMsg{head: head, body: rep.Payload, done: rep.ReleaseBuffer})
}

// openHopReply reads a sealed HopReply of n bytes for w (taken from the
// mux before its buffer is lent; nil: nobody waits), after its first 11
// bytes pre, and hands it over. The reply to a sealed hop must be sealed
// with its keys and name its counter; anything else fails the hop as the
// relay path's fault (errSealPath: the relay could have written it, so the
// peer is not blamed). A reply that fails that check leaves the tunnel's
// framing intact: the tunnel stays.
func (t *tconn) openHopReply(w *hopmux.Waiter, pre [11]byte, r io.Reader, n int) error {
	fail := func(err error) error {
		if w != nil {
			w.Deliver(nil, err)
		}
		return nil
	}
	var k *sealKeys
	if w != nil {
		k, _ = w.Seal.(*sealKeys)
	}
	var sp [wire.SealPrefixLen]byte
	// The waiter is already taken (hopmux readReply): every return that
	// ends the tunnel still answers it, or its sender waits forever.
	if n < len(pre)+len(sp)+wire.SealOverhead {
		err := fmt.Errorf("malformed HopReply frame: %w", hopmux.ErrShortFrame)
		fail(fmt.Errorf("%w: %v", errRelayLost, err))
		return err
	}
	if _, err := io.ReadFull(r, sp[:]); err != nil {
		fail(fmt.Errorf("%w: %v", errRelayLost, err))
		return err
	}
	clen := n - len(pre) - len(sp)
	if k == nil || [wire.SealKeyIDLen]byte(sp[:wire.SealKeyIDLen]) != k.id {
		if err := hopmux.Discard(r, clen); err != nil {
			fail(fmt.Errorf("%w: %v", errRelayLost, err))
			return err
		}
		return fail(errSealOpen)
	}
	buf := sealBuf(clen)
	defer putSealBuf(buf)
	if _, err := io.ReadFull(r, *buf); err != nil {
		fail(fmt.Errorf("%w: %v", errRelayLost, err))
		return err
	}
	plain, err := k.open(binary.BigEndian.Uint64(sp[wire.SealKeyIDLen:]), *buf)
	if err != nil {
		return fail(err)
	}
	if len(plain) < 8 || binary.BigEndian.Uint64(plain) != w.Ctr {
		return fail(fmt.Errorf("%w: a sealed reply answers another hop", errSealPath))
	}
	_, rep, err := hopmux.ReadHopReply(io.MultiReader(bytes.NewReader(pre[:8]), bytes.NewReader(plain[8:])), len(plain), w.Buffer())
	if err != nil {
		return fail(fmt.Errorf("malformed sealed HopReply: %w", err))
	}
	w.Deliver(rep, nil)
	return nil
}

// checkPlainReply fails a plain reply to a sealed hop: the seal_unknown
// one makes the sender exchange keys again first, any other is the relay
// path's fault (errSealPath).
func checkPlainReply(w *hopmux.Waiter, rep *wire.HopReply) error {
	if w.Seal == nil {
		return nil
	}
	if rep.Kind == wire.ReplyError && isSealUnknown(rep) {
		return errSealUnknown
	}
	return fmt.Errorf("%w: the reply to a sealed hop was not sealed (status %d)", errSealPath, rep.Status)
}

func isSealUnknown(rep *wire.HopReply) bool {
	e, ok := wire.DecodeError(rep.Status, rep.Body)
	return ok && e.Type == wire.TypeSealUnknown
}

// sealTo returns the keys for hops to peer, exchanging them through the
// relay first if needed (seal.go); hops to one peer share one exchange,
// each waiting within its own ctx. A peer whose tunnel serves no Hop
// frames (501), or an older one that has no /hop/seal (404, 405), gives
// wire.ErrHopFramesUnsupported; a busy one *sealBusy; an exchange that
// fails otherwise is the relay path's fault (errSealPath).
func (t *tconn) sealTo(ctx context.Context, peer string) (*sealKeys, error) {
	for {
		t.sealMu.Lock()
		sl, _ := t.sealOut.Get(peer)
		if sl == nil {
			sl = &sealSlot{}
			t.sealOut.Put(peer, sl)
		}
		if k := sl.k; k != nil {
			t.sealMu.Unlock()
			return k, nil
		}
		x := sl.x
		if x == nil {
			x = &sealExchange{done: make(chan struct{})}
			sl.x = x
			t.sealMu.Unlock()
			x.k, x.err = t.exchangeSeal(ctx, peer)
			t.sealMu.Lock()
			sl.x, sl.k = nil, x.k
			t.sealMu.Unlock()
			close(x.done)
			return x.k, x.err
		}
		t.sealMu.Unlock()
		select {
		case <-x.done:
			if x.err == nil || ctx.Err() != nil || !errors.Is(x.err, context.Canceled) && !errors.Is(x.err, context.DeadlineExceeded) {
				return x.k, x.err
			}
			// its sender gave up waiting; this hop exchanges on its own time
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// sealBusy is a busy answer to the key exchange: the peer holds as many
// peers' keys as it may, or serves its maximum of exchanges. The hop is
// answered as back-pressure, as a busy peer's hop is.
type sealBusy struct{ msg string }

func (e *sealBusy) Error() string { return "relay: hop key exchange: " + e.msg }

// exchangeSeal runs one key exchange with peer through the relay.
func (t *tconn) exchangeSeal(ctx context.Context, peer string) (*sealKeys, error) {
	eph, hello, err := newSealHello(t.o.id, peer)
	if err != nil {
		return nil, err
	}
	resp, sb, err := t.roundTrip(ctx, peer, http.MethodPost, wire.HopSealPath, nil, hello)
	var re *RelayError
	switch {
	case errors.As(err, &re) && (re.Code == http.StatusNotImplemented || re.Code == http.StatusUpgradeRequired):
		return nil, fmt.Errorf("%w: %s", wire.ErrHopFramesUnsupported, re.Message)
	case errors.As(err, &re) && busy(re):
		return nil, &sealBusy{msg: re.Message}
	case err != nil:
		return nil, err
	case sb != nil:
		sb.Close()
		return nil, fmt.Errorf("%w: the hop key exchange was answered with a stream", errSealPath)
	}
	msg := wire.Truncate(string(resp.Body), 200)
	if e, ok := wire.DecodeError(int(resp.Status), resp.Body); ok {
		msg = wire.Truncate(e.Message, 200)
	}
	switch resp.Status {
	case http.StatusOK:
	case http.StatusNotFound, http.StatusMethodNotAllowed:
		// An older node's mux: it takes plain hops (trust on first
		// contact, as POST /forward); DoHop refuses this for a peer that
		// sealed before.
		return nil, fmt.Errorf("%w: POST %s answered %d", wire.ErrHopFramesUnsupported, wire.HopSealPath, resp.Status)
	case http.StatusTooManyRequests:
		return nil, &sealBusy{msg: msg}
	default:
		// An honest peer refuses only a hello the relay altered or named
		// the wrong source for.
		return nil, fmt.Errorf("%w: peer %s refused the hop key exchange: %d %s", errSealPath, wire.Truncate(peer, 80), resp.Status, msg)
	}
	k, err := finishSeal(t.o.id, peer, eph, resp.Body)
	if err != nil {
		return nil, fmt.Errorf("%w: hop key exchange with %s: %v", errSealPath, wire.Truncate(peer, 80), err)
	}
	return k, nil
}

// forgetSeal drops k, the keys for peer, after the peer said it no longer
// knows them.
func (t *tconn) forgetSeal(peer string, k *sealKeys) {
	t.sealMu.Lock()
	defer t.sealMu.Unlock()
	if sl, _ := t.sealOut.Get(peer); sl != nil && sl.k == k {
		sl.k = nil
	}
}

// hopRoundTrip sends one Hop frame to peer through the relay, sealed to
// peer (seal.go), and waits for its reply or ctx. It returns only once
// payload is no longer read (sealed into a buffer of its own, or the
// tunnel closed), so the caller may reuse the buffer.
func (t *tconn) hopRoundTrip(ctx context.Context, peer string, h *wire.HopHead, payload []byte, into hopmux.ReplyBuffer) (*wire.HopReply, error) {
	for try := 0; ; try++ {
		k, err := t.sealTo(ctx, peer)
		var sb *sealBusy
		if errors.As(err, &sb) {
			return hopmux.ErrorReply(http.StatusTooManyRequests, wire.TypeOverloaded, sb.Error()), nil
		}
		if err != nil {
			return nil, err
		}
		rep, err := t.sealedRoundTrip(ctx, peer, k, h, payload, into)
		if errors.Is(err, errSealUnknown) && try == 0 {
			t.forgetSeal(peer, k) // the peer's tunnel restarted: exchange again
			continue
		}
		return rep, err
	}
}

// sealedRoundTrip is one try of hopRoundTrip with keys k: the mux
// encodes the hop and lists its waiter, and writeSealedHop seals and sends
// it. The waiter's keys and counter are set before the mux lists it: a
// reply read for its stream id, forged or not, then finds them.
func (t *tconn) sealedRoundTrip(ctx context.Context, peer string, k *sealKeys, h *wire.HopHead, payload []byte, into hopmux.ReplyBuffer) (*wire.HopReply, error) {
	w := hopmux.NewWaiter(into)
	w.Seal, w.Ctr = k, k.reserve()
	return t.mux.SendHop(ctx, w, peer, h, payload)
}

// writeSealedHop is the mux's WriteSealed: it seals the plain Hop frame
// head and payload to w's keys and counter and sends the sealed frame.
// Everything after the routing prefix is sealed, in a buffer of its own
// (head b32 and payload), returned once written.
func (t *tconn) writeSealedHop(w *hopmux.Waiter, head, payload []byte, done func()) error {
	k := w.Seal.(*sealKeys)
	route := hopmux.FrameHeaderLen + 9 + int(head[hopmux.FrameHeaderLen+8])
	plain := len(head) - route + len(payload)
	sealed := sealBuf(plain + wire.SealOverhead)
	copy((*sealed)[copy(*sealed, head[route:]):], payload)
	body := k.sealAt(w.Ctr, *sealed, plain)
	*sealed = body
	head = binary.BigEndian.AppendUint32(head[:route], wire.SealedHopMark)
	head = append(head, k.id[:]...)
	head = binary.BigEndian.AppendUint64(head, w.Ctr)
	binary.BigEndian.PutUint32(head[1:], uint32(len(head)-hopmux.FrameHeaderLen+len(body)))
	if !t.fits(head, body) {
		putSealBuf(sealed)
		return errors.New("relay: " + t.tooLarge("hop", head, body))
	}
	if !t.c.sendNow(outMsg{head: head, body: body, done: func() { putSealBuf(sealed); done() }}) {
		return fmt.Errorf("%w: %v", errRelayLost, t.c.cause())
	}
	return nil
}
