package sched

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"meshgpu/internal/testenv"
	"meshgpu/native"
)

// direct runs tokens through layers first..last in dt with the stack's own
// calls: the reference for a work of that Stage.
func direct(t *testing.T, st native.Stack, sess native.Session, tokens []int32, first, last int, dt native.DType) []byte {
	t.Helper()
	act := make([]byte, len(tokens)*st.Config().Hidden*dt.Size())
	if err := st.Embed(tokens, dt, act); err != nil {
		t.Fatal(err)
	}
	if err := st.Forward([]native.Step{{Session: sess, Pos: 0, NTokens: len(tokens)}}, first, last, dt, act, act); err != nil {
		t.Fatal(err)
	}
	return act
}

// TestStagesOnOneScheduler: works of different layer ranges and dtypes,
// submitted at once to the stack's one scheduler, each get what a direct
// call of their range gives (a call holds works of one Stage); a range
// outside the scheduler's is refused.
func TestStagesOnOneScheduler(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, _ := loadModel(t)
	s := newSched(t, m, Config{Linger: 20 * time.Millisecond})
	mid := m.Config.NumLayers/2 - 1
	stages := []Stage{{m.First, mid, native.F32}, {mid + 1, m.Last, native.BF16}, {m.First, m.Last, native.BF16}, {m.First, mid, native.F32}}
	tokens := []int32{3, 1, 4, 1, 5}
	got := make([][]byte, len(stages))
	errs := make([]error, len(stages))
	var wg sync.WaitGroup
	for i, stg := range stages {
		in := make([]byte, len(tokens)*m.Config.Hidden*stg.DType.Size())
		if err := m.Stack.Embed(tokens, stg.DType, in); err != nil {
			t.Fatal(err)
		}
		sess := newSession(t, m, 8)
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := s.Submit(context.Background(), Work{Session: sess, Stage: &stg, Acts: in})
			got[i], errs[i] = res.Acts, err
		}()
	}
	wg.Wait()
	for i, stg := range stages {
		want := direct(t, m.Stack, newSession(t, m, 8), tokens, stg.First, stg.Last, stg.DType)
		if errs[i] != nil || !slices.Equal(got[i], want) {
			t.Errorf("work %d (layers %d-%d, %s): %v; rows equal to a direct call: %v", i, stg.First, stg.Last, stg.DType, errs[i], slices.Equal(got[i], want))
		}
	}
	bad := Stage{m.First, m.Last + 1, native.F32}
	if _, err := s.Submit(context.Background(), Work{Session: newSession(t, m, 8), Stage: &bad, Tokens: []int32{1}}); err == nil {
		t.Error("a range past the scheduler's was accepted")
	}
}

// TestEveryRowLogits: a verify pass gets every row's logits, equal to one
// Logits call over the rows of a direct forward, also when the rows run in
// prefill chunks.
func TestEveryRowLogits(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, _ := loadModel(t)
	tokens := []int32{2, 7, 1, 8, 2}
	act := direct(t, m.Stack, newSession(t, m, 8), tokens, m.First, m.Last, native.F32)
	want := make([]float32, len(tokens)*m.Config.Vocab)
	if err := m.Stack.Logits(len(tokens), native.F32, act, want); err != nil {
		t.Fatal(err)
	}
	for _, chunk := range []int{0, 2} {
		s := newSched(t, m, Config{PrefillChunk: chunk})
		res, err := s.Submit(context.Background(), Work{Session: newSession(t, m, 8), Tokens: tokens, Logits: true, EveryRow: true})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(res.Logits, want) {
			t.Errorf("prefill chunk %d: %d logits, equal to every row's of a direct call: %v", chunk, len(res.Logits), slices.Equal(res.Logits, want))
		}
	}
}

// TestUnbatched: MaxBatch < 0 runs each work alone and whole (one call for
// a prompt longer than PrefillChunk), with the results of a direct call.
func TestUnbatched(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, _ := loadModel(t)
	s := newSched(t, m, Config{MaxBatch: -1, PrefillChunk: 2})
	tokens := []int32{9, 9, 8, 7, 6}
	res, err := s.Submit(context.Background(), Work{Session: newSession(t, m, 8), Tokens: tokens})
	if err != nil {
		t.Fatal(err)
	}
	if want := direct(t, m.Stack, newSession(t, m, 8), tokens, m.First, m.Last, native.F32); !slices.Equal(res.Acts, want) {
		t.Error("rows differ from a direct call")
	}
	if st := s.Stats(); st.Calls != 1 || st.Rows != int64(len(tokens)) || st.MaxSessions != 1 {
		t.Errorf("stats %+v, want one call of %d rows", st, len(tokens))
	}
	s.Close()
	if _, err := s.Submit(context.Background(), Work{Session: newSession(t, m, 8), Tokens: tokens}); err != ErrClosed {
		t.Errorf("after Close: %v, want ErrClosed", err)
	}
}
