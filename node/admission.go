package node

import (
	"context"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"golang.org/x/sync/semaphore"

	"meshgpu/wire"
)

// admission bounds the OpenAI requests a head generates at once to its
// session slots; more wait in a FIFO queue of bounded depth and wait, as a
// vLLM server queues rather than rejects. Only a full queue or an expired
// wait answers 429 with Retry-After: back-pressure, not a failure.
type admission struct {
	slots    *semaphore.Weighted // FIFO: a waiter is served before a later TryAcquire
	maxQueue int64               // 0: no queue, a request finding every slot taken gets 429
	wait     time.Duration
	queued   atomic.Int64
	running  atomic.Int64
}

// retryAfterSeconds is the Retry-After of the head's 429s: a slot frees
// when any running generation ends, which at tens of tokens per second is
// seconds at most.
const retryAfterSeconds = 1

func newAdmission(slots, maxQueue int, wait time.Duration) *admission {
	return &admission{slots: semaphore.NewWeighted(int64(slots)), maxQueue: int64(max(maxQueue, 0)), wait: wait}
}

// enter takes a slot, waiting in the queue when none is free; release
// gives it back (once).
func (a *admission) enter(ctx context.Context, m *metrics) (release func(), ae *apiError) {
	if !a.slots.TryAcquire(1) {
		if q := a.queued.Add(1); q > a.maxQueue {
			a.queued.Add(-1)
			return nil, &apiError{Status: http.StatusTooManyRequests, Type: wire.TypeQueueFull, RetryAfter: retryAfterSeconds,
				Message: fmt.Sprintf("every session slot is generating and %d requests are queued (--max-queue); retry later", a.maxQueue)}
		}
		start := time.Now()
		wctx, cancel := context.WithTimeout(ctx, a.wait)
		err := a.slots.Acquire(wctx, 1)
		cancel()
		a.queued.Add(-1)
		m.queueWait.Observe(time.Since(start).Seconds())
		if err != nil {
			if ctx.Err() != nil {
				return nil, &apiError{Status: 499, Type: "canceled", Message: "client went away while queued"}
			}
			return nil, &apiError{Status: http.StatusTooManyRequests, Type: wire.TypeQueueTimeout, RetryAfter: retryAfterSeconds,
				Message: fmt.Sprintf("no session slot came free within %v (--queue-wait); retry later", a.wait)}
		}
	} else {
		m.queueWait.Observe(0)
	}
	a.running.Add(1)
	var done atomic.Bool
	return func() {
		if done.CompareAndSwap(false, true) {
			a.running.Add(-1)
			a.slots.Release(1)
		}
	}, nil
}
