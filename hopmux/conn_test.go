package hopmux

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/wire"
)

// echo answers a hop with its own payload; with hold set it holds each
// hop until its context ends and reports that on held.
type echo struct {
	hold   bool
	held   chan error
	refuse bool
}

func (e *echo) AcceptHop(_ context.Context, h *wire.HopHead) Hop {
	if e.refuse {
		return Refuse(ErrorReply(http.StatusServiceUnavailable, "busy", "no"))
	}
	buf := make([]byte, h.PayloadLen())
	return Accept(buf, func(ctx context.Context, ok bool) *wire.HopReply {
		if !ok {
			return nil
		}
		if e.hold {
			<-ctx.Done()
			e.held <- ctx.Err()
			return ErrorReply(http.StatusGatewayTimeout, "timeout", "held")
		}
		return &wire.HopReply{Status: http.StatusOK, Kind: wire.ReplyActivations, EndLayer: 1,
			NTokens: h.NTokens, Hidden: h.Hidden, DType: h.DType, Payload: buf}
	})
}

// netConn runs a Conn over a TCP connection, as node/hopconn.go does.
type netConn struct {
	nc net.Conn
	br *bufio.Reader
	m  Conn
}

func newNetConn(nc net.Conn, h Handler, timeout time.Duration) *netConn {
	c := &netConn{nc: nc, br: bufio.NewReader(nc)}
	var mu sync.Mutex
	c.m = Conn{Handler: h, Timeout: timeout, Lost: ErrClosed, MaxWaiting: 16,
		Write: func(head, body []byte, done func()) error {
			mu.Lock()
			_, err := nc.Write(append(head[:len(head):len(head)], body...))
			mu.Unlock()
			if done != nil {
				done()
			}
			return err
		},
		OnClose: func(error) { nc.Close() },
	}
	c.m.Start()
	return c
}

func (c *netConn) serve(limit int) error {
	return c.m.Serve(func() (FrameType, io.Reader, int, error) {
		typ, n, err := ReadFrameHeader(c.br, DefaultMaxFrame)
		return typ, c.br, n, err
	}, nil, limit)
}

// listen serves hops to h on 127.0.0.1 until the test ends.
func listen(t *testing.T, h Handler, timeout time.Duration) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			nc, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, nc)
			mu.Unlock()
			c := newNetConn(nc, h, timeout)
			wg.Add(2)
			go func() { defer wg.Done(); c.serve(64) }()
			go func() { defer wg.Done(); c.m.Reap() }()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		for _, nc := range conns {
			nc.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return l.Addr().String()
}

// dialClient is the sending end of a hop connection to addr.
func dialClient(t *testing.T, addr string) *netConn {
	t.Helper()
	nc, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	c := newNetConn(nc, nil, 0)
	done := make(chan struct{})
	go func() { defer close(done); c.serve(1) }()
	t.Cleanup(func() { c.m.Close(ErrClosed); <-done })
	return c
}

func head(n int) *wire.HopHead {
	return &wire.HopHead{Session: "s", NTokens: 1, Hidden: n / 2, DType: wire.DTypeBF16}
}

// rawHop is a Hop frame for stream as an attacker writes it.
func rawHop(t *testing.T, stream uint64, h *wire.HopHead, payload []byte) []byte {
	t.Helper()
	f, err := AppendHopFrame(nil, stream, "", h, len(payload))
	if err != nil {
		t.Fatal(err)
	}
	return append(f, payload...)
}

// readReply reads the next HopReply on an attacker's connection.
func readReply(t *testing.T, br *bufio.Reader) (uint64, *wire.HopReply) {
	t.Helper()
	for {
		typ, n, err := ReadFrameHeader(br, DefaultMaxFrame)
		if err != nil {
			t.Fatalf("reading a reply: %v", err)
		}
		if typ != FrameHopReply {
			Discard(br, n)
			continue
		}
		id, rep, err := ReadHopReply(br, n, func(uint64) ReplyBuffer { return HeapBuffer })
		if err != nil {
			t.Fatal(err)
		}
		return id, rep
	}
}

func TestRoundTripEchoes(t *testing.T) {
	testenv.CheckGoroutines(t)
	c := dialClient(t, listen(t, &echo{}, 0))
	for i := range 3 {
		p := bytes.Repeat([]byte{byte(i + 1)}, 64)
		rep, err := c.m.RoundTrip(context.Background(), "", head(len(p)), p, nil)
		if err != nil {
			t.Fatal(err)
		}
		if rep.Kind != wire.ReplyActivations || !bytes.Equal(rep.Payload, p) {
			t.Fatalf("hop %d: reply kind %d, payload %x, want the echo of %x", i, rep.Kind, rep.Payload, p)
		}
	}
}

// A sender reusing a stream id in flight is refused for that frame; the
// hop already running on it is answered and the connection stays.
func TestDuplicateStreamRefused(t *testing.T) {
	testenv.CheckGoroutines(t)
	e := &echo{hold: true, held: make(chan error, 2)}
	nc, err := net.Dial("tcp", listen(t, e, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	nc.SetDeadline(time.Now().Add(5 * time.Second))
	br := bufio.NewReader(nc)
	p := make([]byte, 8)
	nc.Write(rawHop(t, 7, head(len(p)), p))
	nc.Write(rawHop(t, 7, head(len(p)), p))
	id, rep := readReply(t, br)
	if id != 7 || rep.Status != http.StatusBadRequest || !strings.Contains(string(rep.Body), "already in flight") {
		t.Fatalf("a second hop on stream 7 got stream %d status %d %s; want 400 already in flight", id, rep.Status, rep.Body)
	}
	nc.Write(Frame(FrameCancel, AppendID(nil, 7)))
	select {
	case err := <-e.held:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("the first hop ended with %v, want its Cancel", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the Cancel frame did not end the first hop: the connection was lost")
	}
}

// A refused hop's payload is skipped: the frames after it stay framed.
func TestRefusedPayloadSkipped(t *testing.T) {
	testenv.CheckGoroutines(t)
	nc, err := net.Dial("tcp", listen(t, &echo{refuse: true}, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	nc.SetDeadline(time.Now().Add(5 * time.Second))
	br := bufio.NewReader(nc)
	p := bytes.Repeat([]byte{0xff}, 4096) // would parse as garbage frames if read as such
	for i := uint64(1); i <= 3; i++ {
		nc.Write(rawHop(t, i, head(len(p)), p))
		id, rep := readReply(t, br)
		if id != i || rep.Status != http.StatusServiceUnavailable {
			t.Fatalf("hop %d: stream %d status %d, want the handler's 503", i, id, rep.Status)
		}
	}
}

// A malformed Hop head closes that connection (its framing is lost) and
// only that one.
func TestMalformedHeadClosesOnlyItsConnection(t *testing.T) {
	testenv.CheckGoroutines(t)
	addr := listen(t, &echo{}, 0)
	good := dialClient(t, addr)
	bad, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	f := rawHop(t, 1, head(8), make([]byte, 8))
	f[FrameHeaderLen+9] = 0xee // the head's version byte, after stream u64 and peer b8
	bad.Write(f)
	bad.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadAll(bad); err != nil {
		t.Fatalf("the malformed connection was not closed: %v", err)
	}
	p := make([]byte, 8)
	if _, err := good.m.RoundTrip(context.Background(), "", head(len(p)), p, nil); err != nil {
		t.Fatalf("another connection failed with the malformed one: %v", err)
	}
}

// A sender giving up sends Cancel: the hop's context ends on the server.
func TestGivingUpCancelsTheHop(t *testing.T) {
	testenv.CheckGoroutines(t)
	e := &echo{hold: true, held: make(chan error, 1)}
	c := dialClient(t, listen(t, e, 0))
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := c.m.RoundTrip(ctx, "", head(8), make([]byte, 8), nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("RoundTrip returned %v, want the deadline", err)
	}
	select {
	case err := <-e.held:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("the hop ended with %v, want its Cancel", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the hop ran on after its sender gave up")
	}
}

// A sender that never cancels cannot hold a hop past Timeout.
func TestTimeoutEndsAHeldHop(t *testing.T) {
	testenv.CheckGoroutines(t)
	const timeout = 200 * time.Millisecond
	e := &echo{hold: true, held: make(chan error, 1)}
	nc, err := net.Dial("tcp", listen(t, e, timeout))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	nc.Write(rawHop(t, 1, head(8), make([]byte, 8)))
	select {
	case <-e.held:
	case <-time.After(5 * time.Second):
		t.Fatalf("a hop was held past its %v timeout", timeout)
	}
}

// The connection's end fails the hops waiting on it with Lost.
func TestLostConnectionFailsWaiters(t *testing.T) {
	testenv.CheckGoroutines(t)
	e := &echo{hold: true, held: make(chan error, 1)}
	c := dialClient(t, listen(t, e, 0))
	errc := make(chan error, 1)
	go func() {
		_, err := c.m.RoundTrip(context.Background(), "", head(8), make([]byte, 8), nil)
		errc <- err
	}()
	time.Sleep(50 * time.Millisecond)
	c.nc.Close()
	select {
	case err := <-errc:
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("RoundTrip returned %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a hop kept waiting on a closed connection")
	}
	<-e.held
}
