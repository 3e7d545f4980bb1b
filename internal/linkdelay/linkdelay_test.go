package linkdelay

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"meshgpu/internal/testenv"
)

// echoServer answers every read with the same bytes.
func echoServer(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); io.Copy(c, c) }()
		}
	}()
	return ln.Addr().String()
}

// A request/response exchange over the link costs one RTT, connecting one
// more, and the bytes arrive intact and in order.
func TestRoundTripCostsOneRTT(t *testing.T) {
	testenv.CheckGoroutines(t)
	addr := echoServer(t)
	const rtt = 30 * time.Millisecond
	d := &Dialer{RTT: rtt}
	t0 := time.Now()
	c, err := d.DialContext(context.Background(), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if el := time.Since(t0); el < rtt {
		t.Fatalf("connect took %v, want at least one RTT (%v)", el, rtt)
	}
	msg := make([]byte, 100<<10) // several chunks each way
	for i := range msg {
		msg[i] = byte(i * 7)
	}
	back := make([]byte, len(msg))
	for round := 0; round < 3; round++ {
		t0 = time.Now()
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, back); err != nil {
			t.Fatal(err)
		}
		el := time.Since(t0)
		if el < rtt || el > 4*rtt {
			t.Fatalf("round trip %d took %v, want about one RTT (%v)", round, el, rtt)
		}
		for i := range back {
			if back[i] != msg[i] {
				t.Fatalf("byte %d came back as %d, sent %d", i, back[i], msg[i])
			}
		}
	}
}

func TestReadDeadline(t *testing.T) {
	testenv.CheckGoroutines(t)
	addr := echoServer(t)
	c, err := (&Dialer{RTT: 2 * time.Millisecond}).DialContext(context.Background(), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	buf := make([]byte, 8)
	if _, err := c.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read with nothing sent: %v, want a deadline error", err)
	}
	// A deadline moved while a Read waits takes effect.
	done := make(chan error, 1)
	c.SetReadDeadline(time.Time{})
	go func() { _, err := c.Read(buf); done <- err }()
	time.Sleep(10 * time.Millisecond)
	c.SetReadDeadline(time.Now().Add(5 * time.Millisecond))
	select {
	case err := <-done:
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() {
			t.Fatalf("Read after the deadline moved: %v, want a timeout", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("a Read blocked past a deadline set while it waited")
	}
}

func TestPeerCloseIsEOF(t *testing.T) {
	testenv.CheckGoroutines(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err == nil {
			c.Write([]byte("bye"))
			c.Close()
		}
	}()
	c, err := (&Dialer{RTT: 2 * time.Millisecond}).DialContext(context.Background(), "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	b, err := io.ReadAll(c)
	if err != nil || string(b) != "bye" {
		t.Fatalf("ReadAll = %q, %v; want \"bye\" then EOF", b, err)
	}
}

func TestDialHonoursContext(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
	defer cancel()
	if _, err := (&Dialer{RTT: time.Second}).DialContext(ctx, "tcp", "127.0.0.1:1"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("dial with a 5 ms context over a 1 s link: %v", err)
	}
}

// A Listener's accepted connections cost one RTT per exchange for a plain
// dialer, and carry the bytes intact.
func TestListenerRoundTripCostsOneRTT(t *testing.T) {
	testenv.CheckGoroutines(t)
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	const rtt = 30 * time.Millisecond
	ln := Listener{Listener: inner, RTT: rtt}
	defer ln.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		io.Copy(c, c)
	}()
	c, err := net.Dial("tcp", inner.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	msg := []byte("across the link and back")
	back := make([]byte, len(msg))
	for round := 0; round < 3; round++ {
		t0 := time.Now()
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, back); err != nil {
			t.Fatal(err)
		}
		if el := time.Since(t0); el < rtt {
			t.Fatalf("round %d took %v, want at least one RTT (%v)", round, el, rtt)
		}
		if string(back) != string(msg) {
			t.Fatalf("round %d: %q came back, want %q", round, back, msg)
		}
	}
	c.Close()
	<-done
}

// Bytes written before Close still cross the link, then the close: a
// server that answers and hangs up (Connection: close) is heard.
func TestCloseDeliversWhatWasWritten(t *testing.T) {
	testenv.CheckGoroutines(t)
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := Listener{Listener: inner, RTT: 40 * time.Millisecond}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		c.Write([]byte("last words"))
		c.Close()
	}()
	c, err := net.Dial("tcp", inner.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	b, err := io.ReadAll(c)
	if err != nil || string(b) != "last words" {
		t.Fatalf("read %q, %v; want the bytes written before the close, then EOF", b, err)
	}
}
