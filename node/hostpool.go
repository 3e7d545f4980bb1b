package node

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"sync"

	"meshgpu/native"
)

// hostPool lends activation buffers in the backend's host memory (pinned
// on CUDA, so the device reads a hop body and writes its answer where Go
// reads and writes it: no staging copy for a step that runs alone; a
// batched call gathers its rows into a buffer of the scheduler's and copies
// them back). Buffers come in power-of-two size
// classes, are allocated on demand (cudaHostAlloc is slow, so they are
// kept for reuse), and all of them together, lent or idle, stay within
// limit bytes. A get that would pass the limit first frees idle buffers of
// other classes, then waits for a put until its context ends.
type hostPool struct {
	alloc func(n int) (*native.HostBuffer, error)
	limit int64

	mu      sync.Mutex
	idle    map[int][]*native.HostBuffer // by class size
	total   int64                        // bytes allocated (lent + idle + being allocated)
	lent    int64                        // bytes lent out
	changed chan struct{}                // closed and replaced whenever bytes come back
	closed  bool
}

// minHostClass keeps tiny hops (one token of a small model) from making
// many tiny pinned allocations.
const minHostClass = 4 << 10

var (
	errPoolClosed = errors.New("the node is shutting down")
	errPoolLimit  = errors.New("over the host buffer limit")
)

// newHostPool allocates from be, or from Go memory when be is nil.
func newHostPool(be native.Backend, limit int64) *hostPool {
	p := &hostPool{limit: limit, idle: map[int][]*native.HostBuffer{}, changed: make(chan struct{})}
	if be != nil {
		p.alloc = be.AllocHost
	} else {
		p.alloc = func(n int) (*native.HostBuffer, error) { return &native.HostBuffer{Bytes: make([]byte, n)}, nil }
	}
	return p
}

func hostClass(n int) int {
	if n <= minHostClass {
		return minHostClass
	}
	return 1 << bits.Len(uint(n-1))
}

// hostBuf is a lent buffer; Bytes is the n bytes asked for.
type hostBuf struct {
	Bytes []byte
	hb    *native.HostBuffer
	class int
}

// get lends a buffer of n bytes. It fails with errPoolLimit when n can
// never fit, errPoolClosed after close, ctx's error when no buffer came
// back in time, or the allocator's error.
func (p *hostPool) get(ctx context.Context, n int) (*hostBuf, error) {
	if n <= 0 {
		return nil, fmt.Errorf("host buffer of %d bytes", n)
	}
	class := hostClass(n)
	if n > 1<<40 || int64(class) > p.limit {
		return nil, fmt.Errorf("%w: %d bytes, limit %d", errPoolLimit, n, p.limit)
	}
	for {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil, errPoolClosed
		}
		if l := p.idle[class]; len(l) > 0 {
			hb := l[len(l)-1]
			p.idle[class] = l[:len(l)-1]
			p.lent += int64(class)
			p.mu.Unlock()
			return &hostBuf{Bytes: hb.Bytes[:n], hb: hb, class: class}, nil
		}
		if p.total+int64(class) > p.limit {
			p.evictLocked(int64(class))
		}
		if p.total+int64(class) <= p.limit {
			p.total += int64(class)
			p.lent += int64(class)
			p.mu.Unlock()
			return p.allocate(n, class)
		}
		wait := p.changed
		p.mu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// tryGet lends an idle buffer of n bytes, or allocates one within the
// limit, without waiting; nil when neither can be done at once.
func (p *hostPool) tryGet(n int) *hostBuf {
	b, err := p.get(doneCtx, n)
	if err != nil {
		return nil
	}
	return b
}

// doneCtx is an ended context: get with it never waits.
var doneCtx = func() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}()

// evictLocked frees idle buffers of other classes until need bytes fit.
func (p *hostPool) evictLocked(need int64) {
	for c, l := range p.idle {
		for len(l) > 0 && p.total+need > p.limit {
			l[len(l)-1].Free()
			l = l[:len(l)-1]
			p.total -= int64(c)
		}
		p.idle[c] = l
		if p.total+need <= p.limit {
			return
		}
	}
}

// allocate fills a reservation made under mu (outside it: pinned
// allocation takes milliseconds).
func (p *hostPool) allocate(n, class int) (*hostBuf, error) {
	hb, err := p.alloc(class)
	if err == nil && len(hb.Bytes) < class {
		hb.Free()
		err = fmt.Errorf("host allocator returned %d bytes, want %d", len(hb.Bytes), class)
	}
	if err != nil {
		p.mu.Lock()
		p.total -= int64(class)
		p.lent -= int64(class)
		p.wakeLocked()
		p.mu.Unlock()
		return nil, fmt.Errorf("allocating %d bytes of host memory: %w", class, err)
	}
	return &hostBuf{Bytes: hb.Bytes[:n], hb: hb, class: class}, nil
}

// put returns b; after close it is freed instead.
func (p *hostPool) put(b *hostBuf) {
	if b == nil || b.hb == nil {
		return
	}
	class, hb := b.class, b.hb
	b.hb, b.Bytes = nil, nil
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lent -= int64(class)
	if p.closed {
		hb.Free()
		p.total -= int64(class)
		return
	}
	p.idle[class] = append(p.idle[class], hb)
	p.wakeLocked()
}

func (p *hostPool) wakeLocked() {
	close(p.changed)
	p.changed = make(chan struct{})
}

// close frees the idle buffers now and lent ones when they come back;
// later gets fail.
func (p *hostPool) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	p.closed = true
	for c, l := range p.idle {
		for _, hb := range l {
			hb.Free()
			p.total -= int64(c)
		}
	}
	clear(p.idle)
	p.wakeLocked()
}

// usage reports bytes allocated and bytes lent.
func (p *hostPool) usage() (allocated, lent int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.total, p.lent
}

// fencedReader is a hop body over a lent buffer. http.Transport may still
// read a request body after Do returns (an early answer, a retry's
// GetBody), and the buffer goes back to the pool, or is freed, right after:
// fence ends every reader at once, waiting at most for one Read's copy.
type fencedReader struct {
	f   *bodyFence
	off int
}

type bodyFence struct {
	mu     sync.Mutex
	b      []byte
	fenced bool
}

var errBodyFenced = errors.New("hop body buffer already released")

func (f *bodyFence) reader() io.ReadCloser { return &fencedReader{f: f} }

// fence ends every reader of the buffer; call it before releasing it.
func (f *bodyFence) fence() {
	f.mu.Lock()
	f.fenced = true
	f.b = nil
	f.mu.Unlock()
}

func (r *fencedReader) Read(p []byte) (int, error) {
	r.f.mu.Lock()
	defer r.f.mu.Unlock()
	if r.f.fenced {
		return 0, errBodyFenced
	}
	if r.off >= len(r.f.b) {
		return 0, io.EOF
	}
	n := copy(p, r.f.b[r.off:])
	r.off += n
	return n, nil
}

func (r *fencedReader) Close() error { return nil }
