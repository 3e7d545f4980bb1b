package native

import (
	"os"
	"sync"
	"testing"
)

// eachHostBackend runs f on a fresh CPU backend and, where
// MESHGPU_CUDA_LIB is set (the device check), a fresh CUDA backend, whose
// host buffers are pinned and whose Free after Close used to read the
// freed backend. f owns the backend and closes it.
func eachHostBackend(t *testing.T, f func(t *testing.T, b Backend)) {
	t.Run("cpu", func(t *testing.T) {
		b, err := Open("cpu", Options{Threads: 1})
		if err != nil {
			t.Fatal(err)
		}
		f(t, b)
	})
	t.Run("cuda", func(t *testing.T) {
		path := os.Getenv("MESHGPU_CUDA_LIB")
		if path == "" {
			t.Skip("MESHGPU_CUDA_LIB is not set: pinned host buffers are checked on a GPU host")
		}
		b, err := Open("cuda", Options{CUDALib: path})
		if err != nil {
			t.Fatal(err)
		}
		f(t, b)
	})
}

func liveHost(t *testing.T, b Backend) int {
	t.Helper()
	cb, ok := b.(*cBackend)
	if !ok {
		t.Fatalf("backend %T is not a *cBackend", b)
	}
	return cb.liveHostBuffers()
}

// Close frees the host buffers still live; their Free afterwards, and a
// second Free, are no-ops (a double free aborts the process in glibc, and
// on CUDA Free after Close would read the freed backend).
func TestHostBufferFreedByClose(t *testing.T) {
	eachHostBackend(t, testHostBufferFreedByClose)
}

func testHostBufferFreedByClose(t *testing.T, b Backend) {
	a, err := b.AllocHost(4096)
	if err != nil {
		t.Fatal(err)
	}
	c, err := b.AllocHost(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	d, err := b.AllocHost(64)
	if err != nil {
		t.Fatal(err)
	}
	if n := liveHost(t, b); n != 3 {
		t.Fatalf("%d live host buffers after 3 allocations", n)
	}
	d.Free()
	d.Free()
	if n := liveHost(t, b); n != 2 {
		t.Fatalf("%d live host buffers after freeing 1 of 3 (twice)", n)
	}
	a.Bytes[0], c.Bytes[len(c.Bytes)-1] = 1, 2
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if n := liveHost(t, b); n != 0 {
		t.Fatalf("%d live host buffers after Close", n)
	}
	a.Free()
	a.Free()
	c.Free()
	if a.Bytes != nil || c.Bytes != nil {
		t.Error("Free left Bytes set")
	}
	if _, err := b.AllocHost(64); err == nil {
		t.Error("AllocHost after Close: no error")
	}
	if err := b.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// Frees racing Close free every buffer exactly once (run with -race; a
// double free aborts).
func TestHostBufferFreeRacesClose(t *testing.T) {
	eachHostBackend(t, testHostBufferFreeRacesClose)
}

func testHostBufferFreeRacesClose(t *testing.T, b Backend) {
	var err error
	bufs := make([]*HostBuffer, 64)
	for i := range bufs {
		if bufs[i], err = b.AllocHost(256 + i); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	for _, hb := range bufs {
		wg.Add(1)
		go func() { defer wg.Done(); hb.Free() }()
	}
	b.Close()
	wg.Wait()
	if n := liveHost(t, b); n != 0 {
		t.Fatalf("%d live host buffers after Close and Free", n)
	}
}
