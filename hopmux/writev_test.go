package hopmux

import (
	"bytes"
	"io"
	"net"
	"testing"
)

// wrapped hides the *net.TCPConn behind a plain io.Writer, as a wrapper
// without WriteBuffers does.
type wrapped struct{ c net.Conn }

func (w wrapped) Write(p []byte) (int, error) { return w.c.Write(p) }

type offering struct {
	wrapped
	calls int
}

func (o *offering) WriteBuffers(b *net.Buffers) (int64, error) {
	o.calls++
	return b.WriteTo(o.c)
}

func TestWriteUsesWriteBuffersAndKeepsOrder(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	got := make(chan []byte, 1)
	go func() {
		p, _ := io.ReadAll(io.LimitReader(b, 10))
		got <- p
	}()
	o := &offering{wrapped: wrapped{a}}
	var f Writev
	n, err := f.Write(o, []byte("head:"), []byte("12345"))
	if err != nil || n != 10 {
		t.Fatalf("Write = %d, %v", n, err)
	}
	if o.calls != 1 {
		t.Fatalf("WriteBuffers called %d times, want 1", o.calls)
	}
	if p := <-got; !bytes.Equal(p, []byte("head:12345")) {
		t.Fatalf("peer read %q", p)
	}
}

func TestWriteFallsBackToOneWritePerBuffer(t *testing.T) {
	var buf bytes.Buffer
	nb := net.Buffers{[]byte("ab"), nil, []byte("cd")}
	if n, err := WriteBuffers(&buf, &nb); err != nil || n != 4 || buf.String() != "abcd" {
		t.Fatalf("Write = %d, %v, %q", n, err, buf.String())
	}
}
