package node

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"time"

	"meshgpu/native"
	"meshgpu/sched"
)

// Continuous batching on this node: every step (the head pipeline's steps,
// incoming hops of any session, verify passes) goes through the stack's one
// sched.Scheduler, each work naming its layer range (a route may enter an
// overlapping shard mid-range) and activation dtype; it runs whatever
// compatible work is waiting when the stack is free as one forward call.
// The scheduler's results are batch-invariant on the CPU backend, so a
// session's ids do not depend on who else is in the call
// (TestBatchedSessionsMatchOneAtATime).

// batchers holds the node's scheduler, made on first use.
type batchers struct {
	mu     sync.Mutex
	sc     *sched.Scheduler
	closed bool
}

// scheduler is the stack's scheduler; nil when the node is closing.
// MaxBatch < 0 makes it run each step alone on its caller's goroutine.
func (s *Server) scheduler() (*sched.Scheduler, error) {
	b := &s.batch
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, nil
	}
	if b.sc == nil {
		sc, err := sched.New(s.stack, s.cfg.First, s.cfg.Last, sched.Config{MaxBatch: s.MaxBatch, PrefillChunk: s.PrefillChunk,
			OnCall: s.metrics.batchDone})
		if err != nil {
			return nil, err
		}
		b.sc = sc
	}
	return b.sc, nil
}

// closeBatchers stops the scheduler (queued work fails with 503).
func (s *Server) closeBatchers() {
	b := &s.batch
	b.mu.Lock()
	b.closed = true
	sc := b.sc
	b.sc = nil
	b.mu.Unlock()
	if sc != nil {
		sc.Close()
	}
}

// runStage runs layers first..last of this node for one session through
// the stack's scheduler. act holds n rows in dt, run in place when the step
// runs alone; with tokens they are embedded into it first; logits, when
// set, gets the last row's (or every row's when it holds n rows of the
// vocabulary: a speculative verify pass).
func (s *Server) runStage(ctx context.Context, sess native.Session, first, last, pos, n int, tokens []int32, dt native.DType, act []byte, logits []float32) error {
	return s.runTreeStage(ctx, sess, first, last, pos, n, tokens, nil, dt, act, logits)
}

// runTreeStage is runStage for rows that may be a token tree (parents,
// native.Step's; nil: a chain).
func (s *Server) runTreeStage(ctx context.Context, sess native.Session, first, last, pos, n int, tokens, parents []int32, dt native.DType, act []byte, logits []float32) error {
	if tokens != nil {
		// embedded here, into the caller's (host pool) buffer: the
		// scheduler then runs a step alone in place on it
		if err := s.stack.Embed(tokens, dt, act); err != nil {
			return err
		}
	}
	w := sched.Work{Session: sess, Pos: pos, Stage: &sched.Stage{First: first, Last: last, DType: dt},
		Acts: act[:n*s.cfg.Hidden*dt.Size()], Logits: logits != nil, EveryRow: n > 1 && len(logits) == n*s.cfg.Vocab, Parents: parents}
	res, err := s.submit(ctx, w)
	if err != nil {
		return err
	}
	if logits != nil {
		copy(logits, res.Logits)
	} else if &res.Acts[0] != &act[0] { // not run in place
		copy(act, res.Acts)
	}
	return nil
}

// submit runs w through the stack's scheduler, its refusals as the
// node's errors.
func (s *Server) submit(ctx context.Context, w sched.Work) (sched.Result, error) {
	sc, err := s.scheduler()
	if err != nil {
		return sched.Result{}, err
	}
	if sc == nil {
		return sched.Result{}, &apiError{Status: http.StatusServiceUnavailable, Type: "shutting_down", Message: "this node is shutting down"}
	}
	res, err := sc.Submit(ctx, w)
	switch {
	case errors.Is(err, sched.ErrQueueFull):
		return res, &apiError{Status: http.StatusServiceUnavailable, Type: "busy", RetryAfter: 1,
			Message: "this node's batch queue is full; retry later"}
	case errors.Is(err, sched.ErrClosed):
		return res, &apiError{Status: http.StatusServiceUnavailable, Type: "shutting_down", Message: "this node is shutting down"}
	case errors.Is(err, context.DeadlineExceeded):
		return res, &apiError{Status: http.StatusGatewayTimeout, Type: "hop_timeout", Message: "the step's deadline passed while it waited for the stack"}
	case errors.Is(err, context.Canceled):
		return res, &apiError{Status: 499, Type: "canceled", Message: "request canceled while its step waited for the stack"}
	}
	return res, err
}

// batchDone records one forward call of the scheduler.
func (m *metrics) batchDone(sessions, rows int, took time.Duration) {
	m.batchSessions.Observe(float64(sessions))
	m.batchRows.Observe(float64(rows))
}
