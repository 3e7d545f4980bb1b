package node

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"meshgpu/engine"
	"meshgpu/native"
	"meshgpu/sched"
)

// Continuous batching on this node: every step (the head pipeline's steps,
// incoming hops of any session) goes through the sched.Scheduler of its
// activation dtype and layer range (a route may enter an overlapping shard
// mid-range), which runs whatever is waiting when the stack is free as one
// forward call. The scheduler's results are
// batch-invariant on the CPU backend, so a session's ids do not depend on
// who else is in the call (TestBatchedSessionsMatchOneAtATime).

// batchers holds the node's schedulers, made on first use.
type batchers struct {
	mu     sync.Mutex
	m      map[batchKey]*sched.Scheduler
	closed bool
}

type batchKey struct {
	dt          native.DType
	first, last int
}

// maxSchedulers bounds the schedulers (each a goroutine) of one node: two
// dtypes times a few ranges in real routes; beyond it steps run alone.
const maxSchedulers = 16

// scheduler is the node's scheduler for dt and layers first..last; nil
// when batching is off (MaxBatch < 0), the node is closing, or it has
// maxSchedulers already.
func (s *Server) scheduler(dt native.DType, first, last int) *sched.Scheduler {
	if s.MaxBatch < 0 {
		return nil
	}
	b := &s.batch
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	key := batchKey{dt, first, last}
	if sc := b.m[key]; sc != nil {
		return sc
	}
	if len(b.m) >= maxSchedulers {
		return nil
	}
	sc, err := sched.New(s.stack, first, last, sched.Config{MaxBatch: s.MaxBatch, PrefillChunk: s.PrefillChunk,
		DType: dt, OnCall: s.metrics.batchDone})
	if err != nil {
		s.Logger.Warn("batching off for these steps", "dtype", dt, "layers", fmt.Sprintf("%d-%d", first, last), "error", err)
		return nil
	}
	if b.m == nil {
		b.m = map[batchKey]*sched.Scheduler{}
	}
	b.m[key] = sc
	return sc
}

// closeBatchers stops the schedulers (queued work fails with 503).
func (s *Server) closeBatchers() {
	b := &s.batch
	b.mu.Lock()
	b.closed = true
	m := b.m
	b.m = nil
	b.mu.Unlock()
	for _, sc := range m {
		sc.Close()
	}
}

// runStage is engine.RunStep of one stage, layers first..last of this
// node, for one session, through the scheduler of its dtype and range
// (alone when batching is off). act holds n rows in dt (in place, as
// RunStep); with tokens they are embedded first; logits, when set, gets
// the last row's.
func (s *Server) runStage(ctx context.Context, sess native.Session, first, last, pos, n int, tokens []int32, dt native.DType, act []byte, logits []float32) error {
	sc := s.scheduler(dt, first, last)
	// The scheduler computes the last row's logits; a verify pass
	// (speculate.go) needs every row's, so it runs alone.
	if sc == nil || (logits != nil && last != s.cfg.Last) || len(logits) > s.cfg.Vocab {
		return engine.RunStep([]engine.Stage{{Stack: s.stack, Session: sess, First: first, Last: last}}, pos, n, tokens, dt, act, logits)
	}
	if tokens != nil {
		// embedded here, into the caller's (host pool) buffer: the
		// scheduler then runs a step alone in place on it
		if err := s.stack.Embed(tokens, dt, act); err != nil {
			return err
		}
	}
	w := sched.Work{Session: sess, Pos: pos, Logits: logits != nil, Acts: act[:n*s.cfg.Hidden*dt.Size()]}
	res, err := sc.Submit(ctx, w)
	switch {
	case errors.Is(err, sched.ErrQueueFull):
		return &apiError{Status: http.StatusServiceUnavailable, Type: "busy", RetryAfter: 1,
			Message: "this node's batch queue is full; retry later"}
	case errors.Is(err, sched.ErrClosed):
		return &apiError{Status: http.StatusServiceUnavailable, Type: "shutting_down", Message: "this node is shutting down"}
	case errors.Is(err, context.DeadlineExceeded):
		return &apiError{Status: http.StatusGatewayTimeout, Type: "hop_timeout", Message: "the step's deadline passed while it waited for the stack"}
	case errors.Is(err, context.Canceled):
		return &apiError{Status: 499, Type: "canceled", Message: "request canceled while its step waited for the stack"}
	case err != nil:
		return err
	}
	if logits != nil {
		copy(logits, res.Logits)
	} else if &res.Acts[0] != &act[0] { // not run in place
		copy(act, res.Acts)
	}
	return nil
}

// batchDone records one forward call of the scheduler.
func (m *metrics) batchDone(sessions, rows int, took time.Duration) {
	m.batchSessions.Observe(float64(sessions))
	m.batchRows.Observe(float64(rows))
}
