package node

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"
	"unsafe"

	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/wire"
)

// hostBackend is the CPU backend with AllocHost recorded: which address
// ranges it handed out and the buffers, so a test can tell whether a slice
// lies in backend host memory and whether every buffer was freed.
type hostBackend struct {
	native.Backend
	mu     sync.Mutex
	bufs   []*native.HostBuffer
	ranges [][2]uintptr
}

func newHostBackend(t testing.TB) *hostBackend {
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	return &hostBackend{Backend: be}
}

func (b *hostBackend) AllocHost(n int) (*native.HostBuffer, error) {
	hb, err := b.Backend.AllocHost(n)
	if err != nil {
		return nil, err
	}
	start := uintptr(unsafe.Pointer(&hb.Bytes[0]))
	b.mu.Lock()
	b.bufs = append(b.bufs, hb)
	b.ranges = append(b.ranges, [2]uintptr{start, start + uintptr(len(hb.Bytes))})
	b.mu.Unlock()
	return hb, nil
}

// owns reports whether p lies inside one allocation.
func (b *hostBackend) owns(p uintptr, n int) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, r := range b.ranges {
		if p >= r[0] && p+uintptr(n) <= r[1] {
			return true
		}
	}
	return false
}

func (b *hostBackend) allocations() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.bufs)
}

// checkAllFreed closes s and checks that every buffer the backend lent it
// was freed (HostBuffer.Free clears Bytes). A buffer still lent to a
// finishing handler is freed when it comes back, so wait for the pool to
// drain; the pool frees under its lock, which orders those writes before
// our reads.
func checkAllFreed(t *testing.T, s *Server, b *hostBackend) {
	t.Helper()
	s.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		allocated, lent := s.hosts.usage()
		if allocated == 0 && lent == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after Close the pool still holds %d bytes (%d lent)", allocated, lent)
		}
		time.Sleep(10 * time.Millisecond)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, hb := range b.bufs {
		if hb.Bytes != nil {
			t.Errorf("host buffer %d of %d not freed by Server.Close", i, len(b.bufs))
		}
	}
}

// probeStack records where Embed and Forward read and write, and can hold
// Forward until gate is closed.
type probeStack struct {
	*fakeStack
	entered chan struct{} // nil, or told of every Forward
	gate    chan struct{} // nil, or Forward waits until it is closed

	mu   sync.Mutex
	ptrs [][2]uintptr // address, length
}

func (p *probeStack) record(b []byte) {
	p.mu.Lock()
	p.ptrs = append(p.ptrs, [2]uintptr{uintptr(unsafe.Pointer(&b[0])), uintptr(len(b))})
	p.mu.Unlock()
}

func (p *probeStack) seen() [][2]uintptr {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([][2]uintptr(nil), p.ptrs...)
}

func (p *probeStack) Embed(tokens []int32, dt native.DType, out []byte) error {
	p.record(out)
	return p.fakeStack.Embed(tokens, dt, out)
}

func (p *probeStack) Forward(steps []native.Step, first, last int, dt native.DType, in, out []byte) error {
	p.record(in)
	p.record(out)
	if p.entered != nil {
		p.entered <- struct{}{}
	}
	if p.gate != nil {
		<-p.gate
	}
	return p.fakeStack.Forward(steps, first, last, dt, in, out)
}

// /forward reads its body into backend host memory, runs the layers there
// and answers the same bytes the Go-memory path gave (the fake layers add
// one per layer); Server.Close frees every buffer.
func TestForwardBodiesInBackendHostMemory(t *testing.T) {
	testenv.CheckGoroutines(t)
	const hidden = 1024
	be := newHostBackend(t)
	st := &probeStack{fakeStack: newFakeStack(0, 2, fkLayers, hidden, fkVocab)}
	s := &Server{StackForTesting: st, Backend: be}
	url := startNode(t, s)
	c := &http.Client{}
	defer c.CloseIdleConnections()
	for i, n := range []int{1, 3, 1, 7, 2} {
		dt := native.BF16
		if i%2 == 1 {
			dt = native.F32
		}
		h := hopReq{session: "host", n: n, hidden: hidden, dtype: dt, start: 0, end: 1, pos: 0, tokens: []int32{5, 9, 2, 4, 1, 3, 8}}
		status, _, body := h.send(t, c, url)
		if status != 200 {
			t.Fatalf("hop %d: %d %s", i, status, body)
		}
		if len(body) != n*hidden*dt.Size() {
			t.Fatalf("hop %d: %d bytes, want %d", i, len(body), n*hidden*dt.Size())
		}
		for r := 0; r < n; r++ {
			want := float32(h.tokens[r] + 2) // layers 0-1 ran
			if got := get(body, dt, r*hidden); got != want || get(body, dt, r*hidden+hidden-1) != want {
				t.Fatalf("hop %d row %d: %v, want %v", i, r, got, want)
			}
		}
	}
	seen := st.seen()
	if len(seen) == 0 {
		t.Fatal("Forward never ran")
	}
	for i, p := range seen {
		if !be.owns(p[0], int(p[1])) {
			t.Fatalf("Forward buffer %d (%#x, %d bytes) is not backend host memory", i, p[0], p[1])
		}
	}
	if be.allocations() == 0 {
		t.Fatal("no AllocHost call")
	}
	checkAllFreed(t, s, be)
}

// The head's generation step embeds into, runs on and sends from backend
// host memory.
func TestPipelineStepInBackendHostMemory(t *testing.T) {
	testenv.CheckGoroutines(t)
	be := newHostBackend(t)
	tail := &Server{StackForTesting: newFakeStack(3, 5, fkLayers, fkHidden, fkVocab)}
	tailURL := startNode(t, tail)
	hst := &probeStack{fakeStack: newFakeStack(0, 2, fkLayers, fkHidden, fkVocab)}
	head := &Server{StackForTesting: hst, Backend: be, Logger: quietLogger()}
	p := headPipeline(t, head, "pipe", []wire.Hop{{Endpoint: tailURL, StartLayer: 3, EndLayer: 5}})
	id, _, ae := p.step(context.Background(), 0, []int32{7, 11}, 0)
	if ae != nil {
		t.Fatal(ae)
	}
	if id != wantToken(11) {
		t.Fatalf("token %d, want %d", id, wantToken(11))
	}
	seen := hst.seen()
	if len(seen) < 2 {
		t.Fatalf("head saw %d Embed/Forward buffers", len(seen))
	}
	for i, ptr := range seen {
		if !be.owns(ptr[0], int(ptr[1])) {
			t.Fatalf("head buffer %d is not backend host memory", i)
		}
	}
	head.sessions.remove("pipe")
	checkAllFreed(t, head, be)
}

// sendRaw is a hop for use off the test goroutine.
func sendRaw(c *http.Client, base, session string, n, hidden int) (int, http.Header, []byte, error) {
	body := make([]byte, n*hidden*2)
	req, err := http.NewRequest(http.MethodPost, base+"/forward", bytes.NewReader(body))
	if err != nil {
		return 0, nil, nil, err
	}
	req.Header.Set(wire.HeaderSession, session)
	req.Header.Set(wire.HeaderShape, strconv.Itoa(n)+","+strconv.Itoa(hidden))
	req.Header.Set(wire.HeaderDType, "bf16")
	req.Header.Set(wire.HeaderStartLayer, "0")
	req.Header.Set(wire.HeaderEndLayer, "1")
	req.Header.Set(wire.HeaderPosition, "0")
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, b, err
}

// MaxInflightBytes bounds the bodies held at once: with two 4 KiB bodies
// held, a third hop waits its deadline and gets 503 busy; one that could
// never fit gets 413 at once; the node keeps serving after both.
func TestMaxInflightBytesBoundsBodies(t *testing.T) {
	testenv.CheckGoroutines(t)
	const hidden = 2048 // one bf16 row: 4 KiB, the smallest class
	be := newHostBackend(t)
	st := &probeStack{fakeStack: newFakeStack(0, 2, fkLayers, hidden, fkVocab),
		entered: make(chan struct{}, 8), gate: make(chan struct{})}
	const timeout = 400 * time.Millisecond
	// Steps alone (no scheduler): the two held hops must be in Forward at
	// once, not one in the call and one queued behind it.
	s := &Server{StackForTesting: st, Backend: be, MaxInflightBytes: 8 << 10, HopTimeout: timeout, MaxBatch: -1}
	url := startNode(t, s)
	c := &http.Client{}
	defer c.CloseIdleConnections()

	type result struct {
		status int
		body   []byte
		err    error
	}
	held := make(chan result, 2)
	for i := 0; i < 2; i++ {
		go func() {
			code, _, b, err := sendRaw(c, url, "held-"+strconv.Itoa(i), 1, hidden)
			held <- result{code, b, err}
		}()
	}
	gateOpen := false
	openGate := func() {
		if !gateOpen {
			gateOpen = true
			close(st.gate)
		}
	}
	defer openGate()
	for i := 0; i < 2; i++ {
		select {
		case <-st.entered:
		case r := <-held:
			t.Fatalf("held hop %d finished early: %d %s %v", i, r.status, r.body, r.err)
		case <-time.After(5 * time.Second):
			t.Fatal("held hops never reached Forward")
		}
	}
	if allocated, lent := s.hosts.usage(); allocated != 8<<10 || lent != 8<<10 {
		t.Fatalf("with two 4 KiB bodies held: %d bytes allocated, %d lent; want 8192 and 8192", allocated, lent)
	}

	// Bounded: without the limit this hop would sit in Forward behind the gate.
	tc := &http.Client{Timeout: 3 * time.Second}
	defer tc.CloseIdleConnections()
	start := time.Now()
	status, hdr, b, err := sendRaw(tc, url, "third", 1, hidden)
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if e := decodeError(t, status, hdr, b); status != 503 || e.Type != "busy" {
		t.Fatalf("third hop over the limit: %d %s, want 503 busy", status, b)
	}
	if took < timeout/2 || took > timeout+2*time.Second {
		t.Errorf("busy answer after %v; want about the hop timeout %v", took, timeout)
	}
	status, hdr, b, err = sendRaw(tc, url, "huge", 3, hidden) // 12 KiB: class 16 KiB > 8 KiB
	if err != nil {
		t.Fatal(err)
	}
	if e := decodeError(t, status, hdr, b); status != 413 || e.Type != "body_too_large" {
		t.Fatalf("hop larger than the limit: %d %s, want 413 body_too_large", status, b)
	}

	openGate()
	for i := 0; i < 2; i++ {
		r := <-held
		if r.err != nil || r.status != 200 || len(r.body) != hidden*2 {
			t.Fatalf("held hop: %d (%d bytes) %v", r.status, len(r.body), r.err)
		}
	}
	if status, _, b, err := sendRaw(c, url, "after", 1, hidden); err != nil || status != 200 {
		t.Fatalf("hop after the busy spell: %d %s %v", status, b, err)
	}
	if allocated, _ := s.hosts.usage(); allocated > 8<<10 {
		t.Fatalf("pool holds %d bytes over its limit of 8192", allocated)
	}
	checkAllFreed(t, s, be)
}

func goPool(limit int64) (*hostPool, *int) {
	allocs := new(int)
	p := newHostPool(nil, limit)
	inner := p.alloc
	p.alloc = func(n int) (*native.HostBuffer, error) { *allocs++; return inner(n) }
	return p, allocs
}

// Size classes, reuse, eviction of idle buffers of other classes, waiting
// for a put, the limit, and close with a buffer still lent.
func TestHostPool(t *testing.T) {
	ctx := context.Background()
	p, allocs := goPool(32 << 10)
	for _, c := range [][2]int{{1, 4 << 10}, {4 << 10, 4 << 10}, {4<<10 + 1, 8 << 10}, {9000, 16 << 10}, {1 << 20, 1 << 20}} {
		if got := hostClass(c[0]); got != c[1] {
			t.Errorf("class of %d bytes: %d, want %d", c[0], got, c[1])
		}
	}
	a, err := p.get(ctx, 5000)
	if err != nil || len(a.Bytes) != 5000 {
		t.Fatalf("get 5000: %v", err)
	}
	p.put(a)
	a, err = p.get(ctx, 6000) // same 8 KiB class: reused
	if err != nil || *allocs != 1 {
		t.Fatalf("get 6000 after a put of the same class: %d allocations, %v", *allocs, err)
	}
	b, err := p.get(ctx, 16<<10)
	if err != nil {
		t.Fatal(err)
	}
	// 24 KiB lent; 16 KiB more does not fit until something comes back.
	wctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	if _, err := p.get(wctx, 10<<10); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("get over the limit: %v, want a deadline error", err)
	}
	cancel()
	got := make(chan error, 1)
	go func() {
		c, err := p.get(ctx, 10<<10)
		if err == nil {
			p.put(c)
		}
		got <- err
	}()
	time.Sleep(20 * time.Millisecond)
	p.put(a) // idle 8 KiB evicted for the waiting 16 KiB
	if err := <-got; err != nil {
		t.Fatalf("waiting get: %v", err)
	}
	if allocated, lent := p.usage(); allocated > 32<<10 || lent != 16<<10 {
		t.Fatalf("allocated %d (limit %d), lent %d (want %d)", allocated, 32<<10, lent, 16<<10)
	}
	if _, err := p.get(ctx, 33<<10); !errors.Is(err, errPoolLimit) {
		t.Fatalf("get larger than the limit: %v", err)
	}
	p.close()
	if allocated, _ := p.usage(); allocated != 16<<10 {
		t.Fatalf("after close with 16 KiB lent: %d bytes allocated", allocated)
	}
	p.put(b)
	if allocated, lent := p.usage(); allocated != 0 || lent != 0 {
		t.Fatalf("after the last put: %d allocated, %d lent", allocated, lent)
	}
	if _, err := p.get(ctx, 1); !errors.Is(err, errPoolClosed) {
		t.Fatalf("get after close: %v", err)
	}
}

// A fenced body ends every reader, including ones made later by GetBody.
func TestBodyFence(t *testing.T) {
	f := &bodyFence{b: []byte("activations")}
	r1 := f.reader()
	got, err := io.ReadAll(r1)
	if err != nil || string(got) != "activations" {
		t.Fatalf("read %q, %v", got, err)
	}
	r2 := f.reader()
	var one [4]byte
	if n, err := r2.Read(one[:]); n != 4 || err != nil {
		t.Fatalf("read %d, %v", n, err)
	}
	f.fence()
	if n, err := r2.Read(one[:]); n != 0 || !errors.Is(err, errBodyFenced) {
		t.Fatalf("read after fence: %d, %v", n, err)
	}
	if n, err := f.reader().Read(one[:]); n != 0 || !errors.Is(err, errBodyFenced) {
		t.Fatalf("new reader after fence: %d, %v", n, err)
	}
}
