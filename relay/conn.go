package relay

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"net"
	"sync"
	"time"

	"github.com/gorilla/websocket"

	"meshgpu/hopmux"
	"meshgpu/internal/deadline"
)

// outMsg is one WebSocket message waiting in a connection's send queue.
// head is written first, then body (so a hop's activations are written
// straight from their buffer), or env is streamed as a JSON envelope.
type outMsg struct {
	head []byte
	body []byte
	env  *envelope
	// done, when set, is called once the message is written or dropped:
	// body's buffer goes back to its pool then.
	done func()
	// borrowed: body is a reading connection's buffer, valid only while
	// writeFast runs (passBody); what it leaves to the writer is copied.
	// Never queued.
	borrowed bool
}

func (m *outMsg) finish() {
	if m.done != nil {
		m.done()
		m.done = nil
	}
}

var errSlowReader = errors.New("send queue full: peer reads too slowly")

// wsConn owns one tunnel connection, a WebSocket or a raw upgraded TCP (or
// TLS) stream (newRawConn): a bounded send queue drained by one writer
// goroutine with a write deadline, so a slow reader only ever blocks its own
// connection; when its queue is full it is dropped.
type wsConn struct {
	ws *websocket.Conn
	// raw, instead of ws, is a raw upgraded tunnel (RawTunnelUpgrade):
	// frames straight on the byte stream, no WebSocket framing or masking.
	raw          net.Conn
	rawR         *bufio.Reader
	q            chan outMsg
	closed       chan struct{}
	once         sync.Once
	writeTimeout time.Duration
	msgType      int
	wmu          sync.Mutex  // held for each message written
	onWrite      func(n int) // bytes written, for metrics; may be nil

	// fast, for a raw tunnel on a plain TCP socket, writes a frame without
	// blocking from the goroutine that has it (writeFast); nil otherwise.
	fast *fastWriter
	// rest is the unwritten tail of a frame writeFast began (from restOff
	// on; hasRest), which the writer goroutine writes before anything
	// else; kick wakes it for that. Under wmu.
	rest    outMsg
	restOff int
	hasRest bool
	kick    chan struct{}

	// readBy and writeBy are the raw socket's deadlines, moved on lazily
	// (package deadline). readBy belongs to the reading goroutine, writeBy
	// to whoever holds wmu.
	readBy, writeBy deadline.Lazy

	// frame is a raw frame's writev list, under wmu.
	frame hopmux.Writev

	mu  sync.Mutex
	err error
}

func newWSConn(ws *websocket.Conn, queue int, writeTimeout time.Duration, msgType int) *wsConn {
	return &wsConn{
		ws:           ws,
		q:            make(chan outMsg, queue),
		closed:       make(chan struct{}),
		writeTimeout: writeTimeout,
		msgType:      msgType,
	}
}

// send queues m without blocking. A full queue closes the connection.
func (c *wsConn) send(m outMsg) bool {
	select {
	case <-c.closed:
		return false
	default:
	}
	select {
	case c.q <- m:
		c.drainIfClosed()
		return true
	case <-c.closed:
		m.finish()
		return false
	default:
		m.finish()
		c.close(errSlowReader)
		return false
	}
}

// drainIfClosed finishes what is queued on a closed connection, so no
// pooled buffer stays lent to a message that will never be written.
func (c *wsConn) drainIfClosed() {
	select {
	case <-c.closed:
	default:
		return
	}
	for {
		select {
		case m := <-c.q:
			m.finish()
		default:
			return
		}
	}
}

// trySend queues m if there is room, and never closes the connection: for
// new requests to a busy peer, which are refused rather than dropping the
// peer (its reading may be fine; it is only popular).
func (c *wsConn) trySend(m outMsg) bool {
	select {
	case c.q <- m:
		c.drainIfClosed()
		return true
	default:
		return false
	}
}

// close closes the connection once, remembering why.
func (c *wsConn) close(err error) {
	c.once.Do(func() {
		c.mu.Lock()
		c.err = err
		c.mu.Unlock()
		close(c.closed)
		defer c.drainIfClosed()
		if c.raw != nil {
			c.raw.Close()
			return
		}
		// A close frame is a courtesy; the socket closes either way.
		c.ws.WriteControl(websocket.CloseMessage,
			websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""), time.Now().Add(100*time.Millisecond))
		c.ws.Close()
	})
}

// cause is why the connection closed (nil while open).
func (c *wsConn) cause() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// writeLoop drains the queue until the connection closes.
func (c *wsConn) writeLoop() {
	defer c.drainIfClosed()
	defer c.dropRest()
	for {
		select {
		case <-c.closed:
			return
		case <-c.kick:
			c.wmu.Lock()
			err := c.writeRest()
			c.wmu.Unlock()
			if err != nil {
				c.writeFailed(err)
				return
			}
		case m := <-c.q:
			c.wmu.Lock()
			err := c.writeRest()
			if err == nil {
				err = c.write(m)
			}
			c.wmu.Unlock()
			m.finish()
			if err != nil {
				c.writeFailed(err)
				return
			}
		}
	}
}

// writeFast writes m from the calling goroutine without ever blocking it:
// only on a plain TCP socket (fast), with nothing queued or being written,
// and only what the socket takes at once. The writer goroutine writes the
// rest, if any, before any other frame. It reports false, m untouched, when
// nothing was written (the caller queues m then); true when m is written,
// left to the writer, or lost with the connection (a write error closes
// it). For frames whose order against queued ones does not matter, as
// sendNow's; for the relay, which must never wait on one peer's socket
// while reading another's frames.
func (c *wsConn) writeFast(m outMsg) bool {
	if c.fast == nil || len(c.q) != 0 || !c.wmu.TryLock() {
		return false
	}
	if c.hasRest || c.isClosed() {
		c.wmu.Unlock()
		return false
	}
	n, called, err := c.fast.write(m.head, m.body)
	if err == errWouldBlock {
		err = nil
	}
	switch {
	case err != nil && called:
		c.wmu.Unlock()
		m.finish()
		c.writeFailed(err)
		return true
	case n == 0:
		// A full socket, a closed one or a lapsed write deadline (which
		// the writer renews): nothing written, the queue takes it.
		c.wmu.Unlock()
		return false
	}
	if c.onWrite != nil {
		c.onWrite(n)
	}
	if n == len(m.head)+len(m.body) {
		c.wmu.Unlock()
		m.finish()
		return true
	}
	if m.borrowed {
		m, n = ownTail(m, n), 0
	}
	c.rest, c.restOff, c.hasRest = m, n, true
	c.wmu.Unlock()
	select {
	case c.kick <- struct{}{}:
	default:
	}
	if c.isClosed() {
		c.dropRest() // the writer may have gone before it could see rest
	}
	return true
}

// ownTail copies what of a borrowed m is unwritten past off into a pooled
// buffer: the message the writer finishes.
func ownTail(m outMsg, off int) outMsg {
	tail := frames.get(len(m.head) + len(m.body) - off)
	k := 0
	if off < len(m.head) {
		k = copy(*tail, m.head[off:])
		off = len(m.head)
	}
	copy((*tail)[k:], m.body[off-len(m.head):])
	done := m.done
	return outMsg{head: *tail, done: func() {
		frames.put(tail)
		if done != nil {
			done()
		}
	}}
}

// writeRest writes what writeFast left, under wmu and the write timeout.
func (c *wsConn) writeRest() error {
	if !c.hasRest {
		return nil
	}
	m, off := c.rest, c.restOff
	c.rest, c.restOff, c.hasRest = outMsg{}, 0, false
	defer m.finish()
	head, body := m.head, m.body
	if off < len(head) {
		head = head[off:]
	} else {
		head, body = nil, body[off-len(head):]
	}
	c.extendWrite()
	_, err := c.frame.Write(c.raw, head, body)
	if c.onWrite != nil {
		c.onWrite(len(head) + len(body))
	}
	return err
}

// dropRest finishes an unwritten rest once the connection is closed.
func (c *wsConn) dropRest() {
	c.wmu.Lock()
	if c.hasRest {
		c.rest.finish()
		c.rest, c.restOff, c.hasRest = outMsg{}, 0, false
	}
	c.wmu.Unlock()
}

func (c *wsConn) isClosed() bool {
	select {
	case <-c.closed:
		return true
	default:
		return false
	}
}

// sendFast writes m at once where writeFast can, else queues it as send.
func (c *wsConn) sendFast(m outMsg) bool {
	return c.writeFast(m) || c.send(m)
}

func (c *wsConn) writeFailed(err error) {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		err = fmt.Errorf("%w: %v", errSlowReader, err)
	}
	c.close(err)
}

// sendNow writes m from the calling goroutine when nothing is queued and
// no write is under way (saving the hand-over to the writer goroutine),
// else queues it as send does. Only for frames whose order against other
// queued frames does not matter (a stream's single Hop or HopReply); the
// caller's goroutine then waits at most the write timeout.
func (c *wsConn) sendNow(m outMsg) bool {
	if len(c.q) == 0 && c.wmu.TryLock() {
		select {
		case <-c.closed:
			c.wmu.Unlock()
			m.finish()
			return false
		default:
		}
		err := c.writeRest()
		if err == nil {
			err = c.write(m)
		}
		c.wmu.Unlock()
		m.finish()
		if err != nil {
			c.writeFailed(err)
			return false
		}
		return true
	}
	return c.send(m)
}

type countingWriter struct {
	w io.Writer
	n int
}

func (cw *countingWriter) Write(p []byte) (int, error) {
	n, err := cw.w.Write(p)
	cw.n += n
	return n, err
}

func (c *wsConn) write(m outMsg) error {
	if c.raw != nil {
		if m.env != nil {
			return errors.New("relay: a JSON envelope on a raw tunnel")
		}
		c.extendWrite()
		_, err := c.frame.Write(c.raw, m.head, m.body) // the body is not copied
		if c.onWrite != nil {
			c.onWrite(len(m.head) + len(m.body))
		}
		return err
	}
	c.ws.SetWriteDeadline(time.Now().Add(c.writeTimeout))
	w, err := c.ws.NextWriter(c.msgType)
	if err != nil {
		return err
	}
	n := 0
	if m.env != nil {
		cw := countingWriter{w: w}
		err = writeEnvelope(&cw, m.env)
		n = cw.n
	} else {
		if _, err = w.Write(m.head); err == nil && len(m.body) > 0 {
			_, err = w.Write(m.body)
		}
		n = len(m.head) + len(m.body)
	}
	if cerr := w.Close(); err == nil {
		err = cerr
	}
	if c.onWrite != nil {
		c.onWrite(n)
	}
	return err
}

// RawTunnelUpgrade is the Upgrade token of the raw tunnel: GET /tunnel
// with "Connection: Upgrade" and this token (instead of a WebSocket
// upgrade) makes the connection a plain stream of the same frames, as
// DERP's is: no WebSocket framing, no client masking, so a payload is
// written straight from its buffer.
const RawTunnelUpgrade = "meshgpu-tunnel/1"

func newRawConn(c net.Conn, br *bufio.Reader, queue int, writeTimeout time.Duration) *wsConn {
	wc := &wsConn{raw: c, rawR: br, q: make(chan outMsg, queue), closed: make(chan struct{}), writeTimeout: writeTimeout}
	// Only the net package's own TCP socket: writing a wrapper's (TLS, a
	// byte counter) file descriptor directly would go around it.
	if tc, ok := c.(*net.TCPConn); ok {
		if wc.fast = newFastWriter(tc); wc.fast != nil {
			wc.kick = make(chan struct{}, 1)
		}
	}
	return wc
}

// extendWrite moves a raw tunnel's write deadline on to a write timeout
// from now (to within an eighth of it: package deadline). Under wmu.
func (c *wsConn) extendWrite() { c.writeBy.Extend(c.raw.SetWriteDeadline, c.writeTimeout) }

// frames returns a reader of whole frames: the next WebSocket message
// (binary only), or the raw stream itself; idle bounds the wait.
func (c *wsConn) frames(idle time.Duration) (io.Reader, error) {
	if c.raw != nil {
		c.extendRead(idle)
		return c.rawR, nil
	}
	c.ws.SetReadDeadline(time.Now().Add(idle))
	mt, r, err := c.ws.NextReader()
	if err != nil {
		return nil, err
	}
	if mt != websocket.BinaryMessage {
		return nil, errors.New("tunnel: text message on a binary tunnel")
	}
	return r, nil
}

// endOfFrames reports whether io.EOF from a frames reader ends the
// connection (raw) rather than one message (WebSocket).
func (c *wsConn) endOfFrames() bool { return c.raw != nil }

// extendRead pushes a raw tunnel's read deadline on to idle from now, at
// each frame, to within an eighth (a WebSocket's is set per message).
func (c *wsConn) extendRead(idle time.Duration) {
	if c.raw != nil {
		c.readBy.Extend(c.raw.SetReadDeadline, idle)
	}
}

// writeNow writes one whole frame before the writer goroutine runs
// (handshakes), under deadline.
func (c *wsConn) writeNow(frame []byte, deadline time.Time) error {
	if c.raw != nil {
		c.writeBy.Set(c.raw.SetWriteDeadline, deadline)
		_, err := c.raw.Write(frame)
		return err
	}
	c.ws.SetWriteDeadline(deadline)
	return c.ws.WriteMessage(websocket.BinaryMessage, frame)
}

// readNow reads one whole frame (handshakes), under deadline.
func (c *wsConn) readNow(max int, deadline time.Time) (hopmux.FrameType, []byte, error) {
	if c.raw != nil {
		c.readBy.Set(c.raw.SetReadDeadline, deadline)
		return hopmux.ReadFrame(c.rawR, max)
	}
	c.ws.SetReadDeadline(deadline)
	return readOneFrame(c.ws, max)
}

func (c *wsConn) clearWriteDeadline() {
	if c.raw != nil {
		c.writeBy.Set(c.raw.SetWriteDeadline, time.Time{})
	} else {
		c.ws.SetWriteDeadline(time.Time{})
	}
}

func (c *wsConn) remoteAddr() string {
	if c.raw != nil {
		return c.raw.RemoteAddr().String()
	}
	return c.ws.RemoteAddr().String()
}

// ping sends a keepalive: a WebSocket ping, or a Ping frame on a raw tunnel.
func (c *wsConn) ping(timeout time.Duration) error {
	if c.raw != nil {
		if !c.send(outMsg{head: hopmux.Frame(hopmux.FramePing, make([]byte, 8))}) {
			return fmt.Errorf("ping: %w", c.cause())
		}
		return nil
	}
	return c.ws.WriteControl(websocket.PingMessage, nil, time.Now().Add(timeout))
}

// framePool lends frame buffers in power-of-two size classes, so the relay
// forwards a hop's bytes without allocating per frame.
type framePool struct{ classes [32]sync.Pool }

var frames framePool

// get lends a buffer of n bytes; put it back with put.
func (p *framePool) get(n int) *[]byte {
	c := bits.Len(uint(max(n, 512) - 1))
	if v := p.classes[c].Get(); v != nil {
		b := v.(*[]byte)
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, 1<<c)
	return &b
}

func (p *framePool) put(b *[]byte) {
	c := bits.Len(uint(cap(*b) - 1))
	if cap(*b) == 1<<c && c < len(p.classes) {
		p.classes[c].Put(b)
	}
}
