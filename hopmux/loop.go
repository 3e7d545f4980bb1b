package hopmux

import "sync"

// serveFrames serves the frames of one connection with a few reused
// goroutines, leader/follower style: the goroutine that reads a frame hands
// the next read to an idle goroutine and then runs the work the frame
// started itself.
//
// Against one reader goroutine that starts a goroutine per frame, the work
// runs where the frame was just read (no hand-off before it starts), the
// reader does not go back to the socket (and the scheduler) first, and the
// goroutines are kept, so their stacks are not grown again for every frame.
//
// It calls read, one goroutine at a time, until it returns an error, and
// runs every work it returns (nil: the frame needed no more) on the
// goroutine that read it, while another reads on. At most limit works run
// at once; beyond that reading waits for one to end (back-pressure). The
// calling goroutine is the first reader. It returns read's error once
// every work has returned, so read should stop the works it started (cancel
// their context) before it returns the error.
func serveFrames(read func() (work func(), err error), limit int) error {
	l := &loop{read: read, max: max(limit, 1), workers: 1}
	l.wg.Add(1)
	l.serve(false)
	l.wg.Wait()
	return l.err
}

// keepIdle is how many idle goroutines a loop keeps once a burst is over.
const keepIdle = 2

type loop struct {
	read func() (func(), error)
	max  int
	turn sync.Mutex // held by the goroutine that reads
	wg   sync.WaitGroup

	mu            sync.Mutex
	workers, idle int // goroutines, and those waiting for the turn
	err           error
}

// serve takes turns reading and working. A goroutine just started is
// counted idle by its starter (counted), so the next reader does not start
// another before it ran.
func (l *loop) serve(counted bool) {
	defer l.wg.Done()
	for {
		if !counted {
			l.mu.Lock()
			l.idle++
			l.mu.Unlock()
		}
		counted = false
		l.turn.Lock()
		l.mu.Lock()
		l.idle--
		failed := l.err != nil
		l.mu.Unlock()
		if failed {
			l.turn.Unlock()
			l.exit()
			return
		}
		work, err := l.read()
		for work == nil && err == nil {
			work, err = l.read()
		}
		l.mu.Lock()
		if err != nil {
			l.err = err
			l.mu.Unlock()
			l.turn.Unlock()
			l.exit()
			return
		}
		if l.idle == 0 && l.workers < l.max {
			l.workers++
			l.idle++
			l.wg.Add(1)
			go l.serve(true)
		}
		l.mu.Unlock()
		l.turn.Unlock()
		work()
		l.mu.Lock()
		shrink := l.idle >= keepIdle
		l.mu.Unlock()
		if shrink {
			l.exit()
			return
		}
	}
}

func (l *loop) exit() {
	l.mu.Lock()
	l.workers--
	l.mu.Unlock()
}
