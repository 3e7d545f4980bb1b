package tracker

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"
)

// A node whose tracker stops answering goes stale (its /ready says 503)
// after StaleAfter heartbeat intervals, although the last word was
// "registered"; the next answer makes it fresh again.
func TestAnnouncerGoesStaleWhenTheTrackerStopsAnswering(t *testing.T) {
	srv, ts := startTracker(t, Config{})
	var down atomic.Bool
	ts.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if down.Load() {
			http.Error(w, `{"error":{"message":"down","type":"server_error"}}`, 500)
			return
		}
		srv.Handler().ServeHTTP(w, r)
	})
	c := &Client{URL: ts.URL, Identity: newIdentity(t), HTTP: httpClient(t)}
	an := &Announcer{
		Client: c, Interval: 20 * time.Millisecond, Logger: quietLogger(),
		Registration: func() Registration { return reg("http://127.0.0.1:7001", 0, 5, 6, 1) },
		Stats:        func() (NodeStats, int64) { return NodeStats{}, 1 << 30 },
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- an.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s (state %+v)", what, an.State())
			}
		}
	}
	waitFor("registration", func() bool { return an.State().Registered && !an.Stale() })
	down.Store(true)
	waitFor("stale", an.Stale)
	if !an.State().Registered {
		t.Fatalf("state %+v: the last word stays registered", an.State())
	}
	down.Store(false)
	waitFor("fresh again", func() bool { return !an.Stale() && an.State().Err == nil })
}
