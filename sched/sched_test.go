package sched

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"meshgpu/engine"
	"meshgpu/internal/testenv"
	"meshgpu/native"
)

type golden struct {
	Generations []struct {
		PromptIDs []int32 `json:"prompt_ids"`
		FP32      struct {
			GreedyIDs []int32 `json:"greedy_ids"`
		} `json:"fp32"`
	} `json:"generations"`
}

func loadGolden(t *testing.T, dir string) *golden {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "golden.json"))
	if err != nil {
		t.Skipf("golden.json: %v", err)
	}
	var g golden
	if err := json.Unmarshal(data, &g); err != nil {
		t.Fatal(err)
	}
	if len(g.Generations) == 0 {
		t.Fatal("golden.json has no generations")
	}
	return &g
}

func loadModel(t *testing.T) (*engine.Model, string) {
	t.Helper()
	dir := testenv.GoCoder(t)
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	m, err := engine.Load(dir, engine.Options{Backend: be, First: 0, Last: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m, dir
}

func newSched(t *testing.T, m *engine.Model, cfg Config) *Scheduler {
	t.Helper()
	s, err := New(m.Stack, m.First, m.Last, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

func newSession(t *testing.T, m *engine.Model, n int) native.Session {
	t.Helper()
	sess, err := m.Stack.NewSession(n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close() })
	return sess
}

const genTokens = 64

// generate runs one greedy generation of genTokens through s.
func generate(t *testing.T, m *engine.Model, s *Scheduler, prompt []int32) ([]int32, error) {
	sess, err := m.Stack.NewSession(len(prompt) + genTokens)
	if err != nil {
		return nil, err
	}
	defer sess.Close()
	p := engine.GenerateParams{MaxTokens: genTokens, IgnoreEOS: true}
	res, err := engine.Decode(context.Background(), m.Tokenizer, m.EOS(), prompt, p, s.Stepper(sess, p.Sampling), nil)
	if err != nil {
		return nil, err
	}
	return res.IDs, nil
}

// alone is the unbatched run: engine's LocalStepper on its own session.
func alone(t *testing.T, m *engine.Model, prompt []int32, dt native.DType) []int32 {
	t.Helper()
	sess := newSession(t, m, len(prompt)+genTokens)
	p := engine.GenerateParams{MaxTokens: genTokens, IgnoreEOS: true}
	res, err := engine.Decode(context.Background(), m.Tokenizer, m.EOS(), prompt, p, m.LocalStepper(sess, p.Sampling, dt), nil)
	if err != nil {
		t.Fatal(err)
	}
	return res.IDs
}

// TestBatchedEqualsUnbatched: on every CPU path, for every golden prompt, the
// greedy ids of 1, 3 or 8 sessions generating at once through one scheduler (prompts in chunks
// of 5, so prefill chunks share calls with other sessions' decode steps)
// equal HF's f32 greedy ids (golden.json) with f32 activations, and equal
// the unbatched run bit for bit with bf16 activations (the CPU backend's
// products are batch-invariant, so no tie band is needed here).
func TestBatchedEqualsUnbatched(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, dir := loadModel(t)
	g := loadGolden(t, dir)
	t.Cleanup(func() { native.SetCPUISA("") })
	// on every matrix-product path (avx512bf16: bf16 activations through vdpbf16ps)
	for _, isa := range native.CPUISAs() {
		t.Run(isa, func(t *testing.T) {
			if err := native.SetCPUISA(isa); err != nil {
				t.Fatal(err)
			}
			batchedEqualsUnbatched(t, m, g)
		})
	}
}

func batchedEqualsUnbatched(t *testing.T, m *engine.Model, g *golden) {
	for _, dt := range []native.DType{native.F32, native.BF16} {
		want := make([][]int32, len(g.Generations))
		for i, gen := range g.Generations {
			if dt == native.F32 {
				want[i] = gen.FP32.GreedyIDs[:genTokens]
			} else {
				want[i] = alone(t, m, gen.PromptIDs, dt)
			}
		}
		for _, n := range []int{1, 3, 8} {
			t.Run(fmt.Sprintf("%s/%d", dt, n), func(t *testing.T) {
				s := newSched(t, m, Config{DType: dt, PrefillChunk: 5, Linger: 20 * time.Millisecond})
				// every prompt runs; n at a time
				for start := 0; start < len(g.Generations); start += n {
					var wg sync.WaitGroup
					got := make([][]int32, n)
					errs := make([]error, n)
					for k := 0; k < n; k++ {
						wg.Add(1)
						go func(k int) {
							defer wg.Done()
							got[k], errs[k] = generate(t, m, s, g.Generations[(start+k)%len(g.Generations)].PromptIDs)
						}(k)
					}
					wg.Wait()
					for k := 0; k < n; k++ {
						i := (start + k) % len(g.Generations)
						if errs[k] != nil {
							t.Fatalf("prompt %d: %v", i, errs[k])
						}
						if !slices.Equal(got[k], want[i]) {
							t.Errorf("prompt %d with %d sessions at once:\n got %v\nwant %v", i, n, got[k], want[i])
						}
					}
				}
				st := s.Stats()
				t.Logf("%d calls, %d session-steps, %d rows, largest call %d sessions", st.Calls, st.Sessions, st.Rows, st.MaxSessions)
				if n > 1 && !(st.MaxSessions > 1) {
					t.Errorf("%d sessions at once never shared a call", n)
				}
			})
		}
	}
}

// TestLongPromptDoesNotStallDecode: while one session prefills 60 tokens in
// chunks of 4 (15 calls), another decodes, one step per call beside it; and
// Config.OnCall sees every call.
func TestLongPromptDoesNotStallDecode(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, _ := loadModel(t)
	var mu sync.Mutex
	var calls, rows, shared int
	onCall := func(sessions, r int, took time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		calls++
		rows += r
		if sessions > 1 {
			shared++
		}
	}
	// a busy machine may be slow to resubmit: wait for both sessions
	s := newSched(t, m, Config{PrefillChunk: 4, Linger: 50 * time.Millisecond, OnCall: onCall})
	long := newSession(t, m, 64)
	short := newSession(t, m, 64)
	prompt := make([]int32, 60)
	for i := range prompt {
		prompt[i] = int32(10 + i)
	}
	// the decoding session has its prompt in first
	if _, err := s.Submit(context.Background(), Work{Session: short, Pos: 0, Tokens: []int32{1, 2, 3}, Logits: true}); err != nil {
		t.Fatal(err)
	}
	prefillDone := make(chan struct{})
	var prefillErr error
	go func() {
		defer close(prefillDone)
		_, prefillErr = s.Submit(context.Background(), Work{Session: long, Pos: 0, Tokens: prompt, Logits: true})
	}()
	// wait until the long prompt is running
	for s.Stats().Calls < 2 {
		time.Sleep(100 * time.Microsecond)
	}
	steps := 0
	for pos := 3; ; pos++ {
		select {
		case <-prefillDone:
			if prefillErr != nil {
				t.Fatal(prefillErr)
			}
			if steps < 5 {
				t.Errorf("only %d decode steps ran during a 15-chunk prefill, want >= 5", steps)
			}
			t.Logf("%d decode steps during the prefill", steps)
			mu.Lock()
			defer mu.Unlock()
			// (the last call's OnCall may still be on its way)
			if calls < 14 || rows < 55+steps || shared < 5 {
				t.Errorf("OnCall saw %d calls, %d rows, %d with two sessions; want >= 14, >= %d, >= 5", calls, rows, shared, 55+steps)
			}
			return
		default:
		}
		if pos >= 64 {
			t.Fatal("the prefill did not finish within 60 decode steps")
		}
		if _, err := s.Submit(context.Background(), Work{Session: short, Pos: pos, Tokens: []int32{5}, Logits: true}); err != nil {
			t.Fatal(err)
		}
		steps++
	}
}

// TestFairness: three prompts of 6 tokens queued at once, in chunks of 2,
// are served in turn (A B C A B C ...), one per call with MaxBatch 1 and two
// per call with MaxBatch 2; nobody's chunk waits behind another's second one.
func TestFairness(t *testing.T) {
	m, _ := loadModel(t)
	for _, c := range []struct {
		maxBatch int
		want     [][]int
	}{
		{1, [][]int{{0}, {1}, {2}, {0}, {1}, {2}, {0}, {1}, {2}}},
		{2, [][]int{{0, 1}, {2, 0}, {1, 2}, {0, 1}, {2}}},
	} {
		s, err := newScheduler(m.Stack, m.First, m.Last, Config{MaxBatch: c.maxBatch, PrefillChunk: 2})
		if err != nil {
			t.Fatal(err)
		}
		sessions := map[native.Session]int{}
		for k := 0; k < 3; k++ {
			sess := newSession(t, m, 6)
			sessions[sess] = k
			s.queue = append(s.queue, &job{ctx: context.Background(), n: 6, result: make(chan error, 1),
				w: Work{Session: sess, Tokens: []int32{1, 2, 3, 4, 5, 6}, Logits: true}})
		}
		var got [][]int
		for len(s.queue) > 0 {
			batch := s.take()
			var ids []int
			for _, p := range batch {
				ids = append(ids, sessions[p.j.w.Session])
			}
			got = append(got, ids)
			s.run(batch)
		}
		if !slices.EqualFunc(got, c.want, slices.Equal) {
			t.Errorf("max batch %d: calls served sessions %v, want %v", c.maxBatch, got, c.want)
		}
	}
}

// TestCancel: cancelling a Submit mid-prefill returns the context's error,
// stops the remaining chunks, and the scheduler goes on serving others.
func TestCancel(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, _ := loadModel(t)
	s := newSched(t, m, Config{PrefillChunk: 1})
	sess := newSession(t, m, 200)
	prompt := make([]int32, 200)
	for i := range prompt {
		prompt[i] = int32(3 + i%50)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		for s.Stats().Calls < 3 {
			time.Sleep(100 * time.Microsecond)
		}
		cancel()
	}()
	_, err := s.Submit(ctx, Work{Session: sess, Pos: 0, Tokens: prompt, Logits: true})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled prefill: %v, want context.Canceled", err)
	}
	time.Sleep(10 * time.Millisecond)
	if n := sess.Len(); n >= len(prompt) {
		t.Errorf("the cancelled prefill ran all %d chunks", n)
	}
	calls := s.Stats().Calls
	time.Sleep(20 * time.Millisecond)
	if c := s.Stats().Calls; c != calls {
		t.Errorf("calls went on after the cancel: %d then %d", calls, c)
	}
	// cancelled before it is taken
	ctx2, cancel2 := context.WithCancel(context.Background())
	cancel2()
	if _, err := s.Submit(ctx2, Work{Session: sess, Pos: 0, Tokens: []int32{1}, Logits: true}); !errors.Is(err, context.Canceled) {
		t.Errorf("submit with a cancelled context: %v", err)
	}
	// still serving
	other := newSession(t, m, 8)
	res, err := s.Submit(context.Background(), Work{Session: other, Pos: 0, Tokens: []int32{1, 2}, Logits: true})
	if err != nil || len(res.Logits) != m.Config.Vocab {
		t.Fatalf("after a cancel: %d logits, %v", len(res.Logits), err)
	}
}

// TestBadWorkFailsAlone: a step at a position past its session's cache,
// queued with a good step so that both are in one call, fails alone (the
// call is retried piece by piece); the good step's logits are those of
// running it by itself.
func TestBadWorkFailsAlone(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, _ := loadModel(t)
	s, err := newScheduler(m.Stack, m.First, m.Last, Config{})
	if err != nil {
		t.Fatal(err)
	}
	good, bad := newSession(t, m, 8), newSession(t, m, 8)
	s.running.Lock() // as if a call ran: both queue
	var wg sync.WaitGroup
	var goodRes Result
	var goodErr, badErr error
	wg.Add(2)
	go func() {
		defer wg.Done()
		goodRes, goodErr = s.Submit(context.Background(), Work{Session: good, Pos: 0, Tokens: []int32{4, 5}, Logits: true})
	}()
	go func() {
		defer wg.Done()
		_, badErr = s.Submit(context.Background(), Work{Session: bad, Pos: 5, Tokens: []int32{4}, Logits: true})
	}()
	waitQueued(s, 2) // both queued before the goroutine starts: one call
	s.running.Unlock()
	go s.loop()
	wg.Wait()
	s.Close()
	if badErr == nil {
		t.Error("a step past its session's cache succeeded")
	}
	if goodErr != nil {
		t.Fatalf("the good step failed beside the bad one: %v", goodErr)
	}
	if st := s.Stats(); st.Calls != 3 || st.MaxSessions != 2 {
		t.Errorf("stats %+v, want 3 calls (the shared one, then each alone) and 2 sessions in the largest", st)
	}
	ref := newSession(t, m, 8)
	want := localLogits(t, m, ref, []int32{4, 5})
	if !slices.Equal(goodRes.Logits, want) {
		t.Error("the good step's logits differ from running it alone")
	}
}

func localLogits(t *testing.T, m *engine.Model, sess native.Session, tokens []int32) []float32 {
	t.Helper()
	row := m.Config.Hidden * 4
	act := make([]byte, len(tokens)*row)
	if err := m.Stack.Embed(tokens, native.F32, act); err != nil {
		t.Fatal(err)
	}
	if err := m.Stack.Forward([]native.Step{{Session: sess, Pos: 0, NTokens: len(tokens)}}, m.First, m.Last, native.F32, act, act); err != nil {
		t.Fatal(err)
	}
	out := make([]float32, m.Config.Vocab)
	if err := m.Stack.Logits(1, native.F32, act[(len(tokens)-1)*row:], out); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestActsInActsOut: activations in, every output row out (a hop), for a
// middle range of layers, equal to calling Forward directly.
func TestActsInActsOut(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, _ := loadModel(t)
	s := newSched(t, m, Config{PrefillChunk: 2})
	tokens := []int32{9, 8, 7, 6, 5}
	row := m.Config.Hidden * 4
	in := make([]byte, len(tokens)*row)
	if err := m.Stack.Embed(tokens, native.F32, in); err != nil {
		t.Fatal(err)
	}
	res, err := s.Submit(context.Background(), Work{Session: newSession(t, m, 8), Pos: 0, Acts: in})
	if err != nil {
		t.Fatal(err)
	}
	want := slices.Clone(in)
	if err := m.Stack.Forward([]native.Step{{Session: newSession(t, m, 8), Pos: 0, NTokens: len(tokens)}}, m.First, m.Last, native.F32, want, want); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(res.Acts, want) {
		t.Error("output rows differ from one direct forward call")
	}
}

// TestClose: queued work fails with ErrClosed, later work too, no goroutine
// is left.
func TestClose(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, _ := loadModel(t)
	s, err := New(m.Stack, m.First, m.Last, Config{PrefillChunk: 1})
	if err != nil {
		t.Fatal(err)
	}
	sess := newSession(t, m, 400)
	errc := make(chan error, 1)
	go func() {
		_, err := s.Submit(context.Background(), Work{Session: sess, Pos: 0, Tokens: make([]int32, 400), Logits: true})
		errc <- err
	}()
	for s.Stats().Calls < 2 {
		time.Sleep(100 * time.Microsecond)
	}
	s.Close()
	if err := <-errc; !errors.Is(err, ErrClosed) {
		t.Errorf("work running at Close: %v, want ErrClosed", err)
	}
	if _, err := s.Submit(context.Background(), Work{Session: sess, Pos: 0, Tokens: []int32{1}}); !errors.Is(err, ErrClosed) {
		t.Errorf("submit after Close: %v, want ErrClosed", err)
	}
}

// TestQueueFull: beyond MaxQueue waiting works, Submit answers ErrQueueFull
// at once (the queue is bounded); the waiting ones still complete.
func TestQueueFull(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, _ := loadModel(t)
	s, err := newScheduler(m.Stack, m.First, m.Last, Config{MaxQueue: 2})
	if err != nil {
		t.Fatal(err)
	}
	// no goroutine yet, and the stack held as if a call ran: the first two
	// wait in the queue
	s.running.Lock()
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for k := 0; k < 2; k++ {
		sess := newSession(t, m, 4)
		wg.Add(1)
		go func(k int) {
			defer wg.Done()
			_, errs[k] = s.Submit(context.Background(), Work{Session: sess, Tokens: []int32{1}, Logits: true})
		}(k)
	}
	waitQueued(s, 2)
	if _, err := s.Submit(context.Background(), Work{Session: newSession(t, m, 4), Tokens: []int32{1}, Logits: true}); !errors.Is(err, ErrQueueFull) {
		t.Errorf("third work with MaxQueue 2: %v, want ErrQueueFull", err)
	}
	s.running.Unlock()
	go s.loop()
	wg.Wait()
	s.Close()
	for k, err := range errs {
		if err != nil {
			t.Errorf("queued work %d: %v", k, err)
		}
	}
}

// TestBadWork: malformed work is refused before it is queued.
func TestBadWork(t *testing.T) {
	m, _ := loadModel(t)
	s := newSched(t, m, Config{})
	sess := newSession(t, m, 8)
	for name, w := range map[string]Work{
		"no session":   {Pos: 0, Tokens: []int32{1}},
		"negative pos": {Session: sess, Pos: -1, Tokens: []int32{1}},
		"no rows":      {Session: sess},
		"both inputs":  {Session: sess, Tokens: []int32{1}, Acts: make([]byte, m.Config.Hidden*4)},
		"partial row":  {Session: sess, Acts: make([]byte, m.Config.Hidden*4+1)},
	} {
		if _, err := s.Submit(context.Background(), w); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := New(m.Stack, 0, m.Config.NumLayers+3, Config{}); err == nil {
		t.Error("New accepted layers beyond the stack")
	}
}

// TestIdleStepRunsOnCaller: a session stepping alone on an idle stack runs
// its call on the submitting goroutine (no hand-off to the scheduler's
// goroutine and back), and a step queued behind a running call still goes
// to the scheduler's goroutine, which batches it.
func TestIdleStepRunsOnCaller(t *testing.T) {
	testenv.CheckGoroutines(t)
	m, _ := loadModel(t)
	var mu sync.Mutex
	var onCaller, onLoop int
	onCall := func(sessions, rows int, took time.Duration) {
		pcs := make([]uintptr, 64)
		frames := runtime.CallersFrames(pcs[:runtime.Callers(2, pcs)])
		inSubmit := false
		for {
			f, more := frames.Next()
			if strings.HasSuffix(f.Function, "sched.(*Scheduler).Submit") {
				inSubmit = true
			}
			if !more {
				break
			}
		}
		mu.Lock()
		defer mu.Unlock()
		if inSubmit {
			onCaller++
		} else {
			onLoop++
		}
	}
	s := newSched(t, m, Config{OnCall: onCall})
	sess := newSession(t, m, 16)
	for pos := 0; pos < 8; pos++ {
		if _, err := s.Submit(context.Background(), Work{Session: sess, Pos: pos, Tokens: []int32{int32(5 + pos)}, Logits: true}); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	if onCaller != 8 || onLoop != 0 {
		t.Errorf("one session alone: %d calls on the caller, %d on the scheduler's goroutine; want 8 and 0", onCaller, onLoop)
	}
	mu.Unlock()

	// A step submitted while the stack is held queues for the goroutine
	// (started only once the Submit has given up on running it itself).
	s2, err := newScheduler(m.Stack, m.First, m.Last, Config{OnCall: onCall})
	if err != nil {
		t.Fatal(err)
	}
	other := newSession(t, m, 16)
	s2.running.Lock()
	done := make(chan error, 1)
	go func() {
		_, err := s2.Submit(context.Background(), Work{Session: other, Pos: 0, Tokens: []int32{7}, Logits: true})
		done <- err
	}()
	for len(s2.wake) == 0 { // signalled: the Submit left the call to the goroutine
		time.Sleep(100 * time.Microsecond)
	}
	s2.running.Unlock()
	go s2.loop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	s2.Close()
	mu.Lock()
	defer mu.Unlock()
	if onLoop != 1 {
		t.Errorf("a step queued behind a running call: %d calls on the scheduler's goroutine, want 1", onLoop)
	}
}

// waitQueued waits until n works wait in s's queue.
func waitQueued(s *Scheduler, n int) {
	for {
		s.mu.Lock()
		q := len(s.queue)
		s.mu.Unlock()
		if q == n {
			return
		}
		time.Sleep(100 * time.Microsecond)
	}
}
