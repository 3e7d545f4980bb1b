package hopmux

import (
	"errors"
	"runtime/metrics"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"meshgpu/internal/testenv"
)

var errEOF = errors.New("end of frames")

// TestWorkRunsWhileTheNextFrameIsRead: work i waits until frame i+1 has been
// read, which a loop that reads and works on one goroutine never does.
func TestWorkRunsWhileTheNextFrameIsRead(t *testing.T) {
	testenv.CheckGoroutines(t)
	const frames = 50
	read := make([]chan struct{}, frames+1)
	for i := range read {
		read[i] = make(chan struct{})
	}
	var n int
	var done atomic.Int32
	err := serveFrames(func() (func(), error) {
		if n == frames {
			close(read[n])
			return nil, errEOF
		}
		i := n
		n++
		close(read[i])
		return func() {
			select {
			case <-read[i+1]:
				done.Add(1)
			case <-time.After(10 * time.Second):
				t.Errorf("work %d: frame %d was never read while it ran", i, i+1)
			}
		}, nil
	}, 8)
	if !errors.Is(err, errEOF) {
		t.Fatalf("serveFrames = %v, want the read error", err)
	}
	if done.Load() != frames {
		t.Fatalf("%d works done when serveFrames returned, want %d", done.Load(), frames)
	}
}

// TestLimitHoldsReadingBack: with limit 2 and works that block, a third
// frame is read only after a work ends.
func TestLimitHoldsReadingBack(t *testing.T) {
	testenv.CheckGoroutines(t)
	release := make(chan struct{})
	var running, most, reads atomic.Int32
	var third sync.Once
	thirdRead := make(chan struct{})
	errc := make(chan error, 1)
	go func() {
		errc <- serveFrames(func() (func(), error) {
			r := reads.Add(1)
			if r == 3 {
				third.Do(func() { close(thirdRead) })
			}
			if r > 4 {
				return nil, errEOF
			}
			return func() {
				most.Store(max(most.Load(), running.Add(1)))
				<-release
				running.Add(-1)
			}, nil
		}, 2)
	}()
	select {
	case <-thirdRead:
		t.Fatal("a third frame was read while two works held the limit")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	if err := <-errc; !errors.Is(err, errEOF) {
		t.Fatalf("serveFrames = %v", err)
	}
	if most.Load() > 2 {
		t.Fatalf("%d works ran at once with limit 2", most.Load())
	}
}

// TestGoroutinesAreReused: a thousand frames one after another start a
// few goroutines, not one per frame, and leave none after serveFrames returns.
func TestGoroutinesAreReused(t *testing.T) {
	testenv.CheckGoroutines(t)
	created := []metrics.Sample{{Name: "/sched/goroutines-created:goroutines"}}
	metrics.Read(created)
	before := created[0].Value.Uint64()
	n := 0
	next := make(chan struct{}, 1)
	next <- struct{}{}
	err := serveFrames(func() (func(), error) {
		<-next // frames arrive one at a time, each after the last work ended
		if n == 1000 {
			return nil, errEOF
		}
		n++
		return func() { next <- struct{}{} }, nil
	}, 100)
	if !errors.Is(err, errEOF) {
		t.Fatalf("serveFrames = %v", err)
	}
	metrics.Read(created)
	// (the test binary's own goroutines are few and not per frame)
	if c := created[0].Value.Uint64() - before; c > 100 {
		t.Fatalf("%d goroutines started for 1000 sequential frames, want a few", c)
	}
}
