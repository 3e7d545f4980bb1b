// Package sched runs the forward calls of one layer stack: every forward
// of a node (its head pipeline, incoming hops, speculative verify passes)
// and of `meshgpu generate` goes through the stack's one Scheduler, which
// owns the stack's admission (a bounded queue, a batch budget of sessions
// and rows) and batches the work of many sessions into shared calls
// (continuous batching, node-local).
//
// Decode is memory-bound: one pass over a layer's weights serves every
// session that has a row ready for the price of about one. A Scheduler owns
// one goroutine that, whenever the stack is free, takes whatever work is
// queued (decode steps and prompt chunks of any number of sessions, up to
// Config.MaxBatch sessions and Config.MaxRows rows), runs it as one
// Stack.Forward call (plus one Embed per token input and one Logits call for
// the rows that want logits), and hands each caller its rows. Works name
// their layer range and activation dtype (Work.Stage; a route may enter a
// shard mid-range, a hop may carry f32 or bf16): a call holds works of one
// range and dtype, the oldest work's, and the others wait for a later call.
// When the stack is idle and one session steps alone, the submitting
// goroutine runs its call itself (no hand-off to the scheduler's goroutine
// and back: the latency of a hop on a quiet node); the goroutine takes over
// as soon as work queues behind it.
//
// Callers submit work and wait for its result:
//
//	res, err := s.Submit(ctx, sched.Work{Session: sess, Pos: pos, Acts: rows, Logits: true})
//
// Acts (rows Hidden elements of the work's dtype each: a hop's, or the
// head's embeddings, which the node writes into its host buffer itself) or
// Tokens (the stack holds the embeddings: a node holding every layer, and
// `meshgpu generate`) go in; out come every output row (to send to the next
// node), or, on a stack holding the head, either the token the backend
// sampled (Work.Sample: the works of a call run as one native.Ends call,
// and only the pick leaves the backend, not Vocab logits per token) or the
// logits (the last row's, or every row's for a verify pass, Work.EveryRow),
// which the caller samples in Go (a verify pass, a token tree, a response
// format's mask, a backend without the ends).
//
// Prompts longer than Config.PrefillChunk rows run in chunks, one per
// forward call, so a long prompt does not stall the sessions decoding
// beside it. Fairness: work is served oldest first, and a prompt's next
// chunk goes to the back of the queue; a session is in a call at most once.
//
// Results do not depend on the batch: on the CPU backend every row's
// arithmetic is the same whatever else is in the call (native's matrix
// products are batch-invariant), so ids and logits are bit-identical to
// running each session alone, and a sampling work picks the token Go's
// sampler picks from the same work's logits.
//
// A session takes one Work at a time: submit its next step after the last
// one returned. At most Config.MaxQueue works wait; beyond that Submit
// answers ErrQueueFull at once (for the node: back-pressure, a 429 with
// Retry-After, not a failure).
//
// Cancelling a Submit's context removes its work from the queue (a chunk
// already running finishes; the session's cache then holds those positions,
// which a retry at the same Pos overwrites). Close fails queued work with
// ErrClosed and waits for the goroutine.
package sched

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"meshgpu/native"
	"meshgpu/sample"
)

// Config sets a Scheduler's limits. The zero value works.
type Config struct {
	// MaxBatch is the most sessions in one forward call (default 8).
	// Negative: no batching, each work runs alone and whole (no prefill
	// chunks) on its submitter's goroutine at once, the stack serializing
	// the calls (what a node runs with --max-batch 0).
	MaxBatch int
	// MaxRows is the most rows (tokens) in one forward call (default 512).
	MaxRows int
	// PrefillChunk is the most rows of one session in one call (default 256,
	// at most MaxRows).
	PrefillChunk int
	// MaxQueue is the most work waiting (default 1024); Submit answers
	// ErrQueueFull beyond it, the caller's cue for back-pressure.
	MaxQueue int
	// DType is the activations' type in and out of the stack for works
	// without a Stage (default F32).
	DType native.DType
	// Linger bounds how long the scheduler waits, after a call, for the
	// sessions of the last two calls to submit their next step before it
	// starts a smaller call: streams sample between steps, and without the
	// wait they split into small batches that take turns. Default (0): an eighth of the
	// last call's time, at most 50ms; negative: never wait.
	Linger time.Duration
	// OnCall, if set, is told of every batched call (from the goroutine that ran
	// it, while the stack waits, so it must be quick): sessions and rows in it, how long it
	// took. For metrics (a batch-size histogram).
	OnCall func(sessions, rows int, took time.Duration)
}

func (c Config) withDefaults() Config {
	if c.MaxBatch == 0 {
		c.MaxBatch = 8
	}
	if c.MaxRows <= 0 {
		c.MaxRows = 512
	}
	if c.PrefillChunk <= 0 {
		c.PrefillChunk = 256
	}
	if c.MaxQueue <= 0 {
		c.MaxQueue = 1024
	}
	if c.PrefillChunk > c.MaxRows {
		c.PrefillChunk = c.MaxRows
	}
	return c
}

// Work is one session's rows at positions Pos..Pos+n-1.
type Work struct {
	Session native.Session
	Pos     int
	// Stage, when set, is the work's layers and dtype; nil: the
	// scheduler's layers and Config.DType.
	Stage *Stage
	// Tokens to embed (the stack must hold the embeddings and the range
	// start at its first layer), or Acts: rows of Hidden elements of the
	// work's dtype. Exactly one of the two.
	Tokens []int32
	Acts   []byte
	// Logits asks for logits (the range must end at the stack's last layer,
	// which holds the head) instead of the output rows: the last row's, or
	// with EveryRow every row's (a speculative verify pass).
	Logits   bool
	EveryRow bool
	// Parents, when set, makes the rows a token tree (native.Step's
	// Parents): it runs in one call, never in chunks.
	Parents []int32
	// Sample, when set, asks the backend to sample the token after the
	// last row (native.Ends; the range must end at the stack's last layer
	// and the stack must have the ends): Result.Choice is its pick, and no
	// logits leave the backend. Not with Logits or Parents.
	Sample *SampleStep
}

// SampleStep is the draw of a sampling work (native.TokenStep's sampling
// fields).
type SampleStep struct {
	Params sample.Params
	// GeneratedFrom: history[GeneratedFrom:] are generated tokens (the
	// presence and frequency penalties count them).
	GeneratedFrom int
	Draw          int // the generated token's index, which seeds its draw
	// Tokens are an Acts work's ids at its positions (a Tokens work's are
	// its own): the backend records them in the session's token history,
	// which its penalties read (meshgpu.h mg_token_step).
	Tokens []int32
}

// Stage is a range of layers, within the scheduler's, and the activations'
// dtype (f32 or bf16): works of one Stage can share a call.
type Stage struct {
	First, Last int
	DType       native.DType
}

// Result is what a Work produced.
type Result struct {
	Acts []byte // every output row (when Work.Logits is false)
	// Logits: the last row's (Vocab values), or with Work.EveryRow every
	// row's (n*Vocab), when Work.Logits is set.
	Logits []float32
	Choice sample.Choice // the backend's pick, when Work.Sample is set
}

// ErrClosed is returned for work submitted to, or queued in, a closed Scheduler.
var ErrClosed = errors.New("sched: scheduler closed")

// ErrQueueFull is returned when Config.MaxQueue works are already waiting.
var ErrQueueFull = errors.New("sched: queue full")

// Stats counts what a Scheduler did.
type Stats struct {
	Calls, Rows, Sessions int64 // forward calls, rows and session-steps they held
	MaxSessions           int   // the largest call, in sessions
	// SampleCalls of the Calls ran sampling works (one native.Ends call
	// each), which sampled Sampled tokens in the backend.
	SampleCalls, Sampled int64
}

// Scheduler runs one stack's work in shared forward calls.
type Scheduler struct {
	st          native.Stack
	ends        native.Ends // nil: the stack cannot sample (Work.Sample refused)
	first, last int
	cfg         Config
	hidden      int
	vocab       int

	mu     sync.Mutex
	queue  []*job // oldest first
	closed bool
	stats  Stats
	alone  sync.WaitGroup // works running alone (MaxBatch < 0); Close waits for them
	wake   chan struct{}  // cap 1: work arrived
	done   chan struct{}  // closed when the goroutine returns
	stop   chan struct{}

	// running is held by whoever runs calls: the scheduler's goroutine
	// (while it has work or lingers for it), or a Submit that found the
	// stack idle. What it guards says which sessions the last two calls
	// held and how long the last took (for the linger).
	running                      sync.Mutex
	lastSessions, beforeSessions []native.Session
	took                         time.Duration
}

// job is a Work in progress: next is its first row not yet run.
type job struct {
	ctx    context.Context
	w      Work
	n      int // rows in all
	next   int
	stage  Stage     // the work's, defaults filled in
	acts   []byte    // output rows so far (Logits false)
	logits []float32 // every row's logits so far (EveryRow)
	result chan error
	res    Result
}

// New starts a scheduler for layers first..last of st. Close stops it.
func New(st native.Stack, first, last int, cfg Config) (*Scheduler, error) {
	s, err := newScheduler(st, first, last, cfg)
	if err != nil {
		return nil, err
	}
	go s.loop()
	return s, nil
}

// newScheduler is New without the goroutine.
func newScheduler(st native.Stack, first, last int, cfg Config) (*Scheduler, error) {
	sc := st.Config()
	if first < sc.First || last > sc.Last || first > last {
		return nil, fmt.Errorf("sched: layers %d..%d not within the stack's %d..%d", first, last, sc.First, sc.Last)
	}
	cfg = cfg.withDefaults()
	if !actDType(cfg.DType) {
		return nil, fmt.Errorf("sched: activation dtype %s, want f32 or bf16", cfg.DType)
	}
	s := &Scheduler{st: st, first: first, last: last, cfg: cfg, hidden: sc.Hidden, vocab: sc.Vocab,
		wake: make(chan struct{}, 1), done: make(chan struct{}), stop: make(chan struct{})}
	if e, ok := st.(native.Ends); ok && sc.HasHead && e.HasEnds() {
		s.ends = e
	}
	return s, nil
}

// CanSample reports whether works ending at the stack's last layer may ask
// the backend to sample (Work.Sample): the stack holds the head and its
// backend has the ends (native.Ends.HasEnds).
func (s *Scheduler) CanSample() bool { return s.ends != nil && s.last == s.st.Config().Last }

// Config is the scheduler's configuration with defaults filled in.
func (s *Scheduler) Config() Config { return s.cfg }

// Stats returns the counters so far.
func (s *Scheduler) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats
}

// Close fails queued work with ErrClosed and waits for the running call.
func (s *Scheduler) Close() {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.stop)
		for _, j := range s.queue {
			j.result <- ErrClosed
		}
		s.queue = nil
	}
	s.mu.Unlock()
	<-s.done
	s.alone.Wait()
	s.running.Lock() // a call a Submit runs ends before the stack may close
	s.running.Unlock()
}

// Submit queues w and waits for its result, ctx's end or Close.
func (s *Scheduler) Submit(ctx context.Context, w Work) (Result, error) {
	sc := s.st.Config()
	if w.Session == nil {
		return Result{}, errors.New("sched: work without a session")
	}
	if w.Pos < 0 {
		return Result{}, fmt.Errorf("sched: negative position %d", w.Pos)
	}
	stage := Stage{First: s.first, Last: s.last, DType: s.cfg.DType}
	if w.Stage != nil {
		stage = *w.Stage
		if stage.First < s.first || stage.Last > s.last || stage.First > stage.Last {
			return Result{}, fmt.Errorf("sched: layers %d..%d not within the scheduler's %d..%d", stage.First, stage.Last, s.first, s.last)
		}
		if !actDType(stage.DType) {
			return Result{}, fmt.Errorf("sched: activation dtype %s, want f32 or bf16", stage.DType)
		}
	}
	row := s.hidden * stage.DType.Size()
	var n int
	switch {
	case len(w.Tokens) > 0 && w.Acts != nil:
		return Result{}, errors.New("sched: work has both tokens and activations")
	case len(w.Tokens) > 0:
		if !sc.HasEmbed || stage.First != sc.First {
			return Result{}, errors.New("sched: token input needs the embeddings and the stack's first layer")
		}
		n = len(w.Tokens)
	case len(w.Acts) > 0:
		if len(w.Acts)%row != 0 {
			return Result{}, fmt.Errorf("sched: %d bytes of activations is not a whole number of %d-byte rows", len(w.Acts), row)
		}
		n = len(w.Acts) / row
	default:
		return Result{}, errors.New("sched: work has no rows")
	}
	if w.Parents != nil && (len(w.Parents) != n || n > s.cfg.PrefillChunk) {
		return Result{}, fmt.Errorf("sched: a tree of %d parents for %d rows (one per row, at most %d, which run in one call)", len(w.Parents), n, s.cfg.PrefillChunk)
	}
	if w.Logits && (!sc.HasHead || stage.Last != sc.Last) {
		return Result{}, errors.New("sched: logits need the head and the stack's last layer")
	}
	if w.EveryRow && !w.Logits {
		return Result{}, errors.New("sched: every row's logits without logits")
	}
	if w.Sample != nil {
		switch {
		case s.ends == nil || stage.Last != sc.Last:
			return Result{}, errors.New("sched: sampling needs the head, the stack's last layer and a backend with the ends (native.Ends)")
		case w.Logits || w.Parents != nil:
			return Result{}, errors.New("sched: a sampling work with logits or a token tree")
		case w.Acts != nil && len(w.Sample.Tokens) != n:
			return Result{}, fmt.Errorf("sched: a sampling work of %d rows with %d token ids", n, len(w.Sample.Tokens))
		}
	}
	j := &job{ctx: ctx, w: w, stage: stage, n: n, result: make(chan error, 1)}
	if s.cfg.MaxBatch < 0 {
		return s.runAlone(j)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return Result{}, ErrClosed
	}
	if len(s.queue) >= s.cfg.MaxQueue {
		s.mu.Unlock()
		return Result{}, ErrQueueFull
	}
	s.queue = append(s.queue, j)
	alone := len(s.queue) == 1
	s.mu.Unlock()
	if !alone || !s.runHere() {
		s.signal()
	}
	select {
	case err := <-j.result:
		if err != nil {
			return Result{}, err
		}
		return j.res, nil
	case <-ctx.Done():
		s.mu.Lock()
		queued := s.remove(j)
		s.mu.Unlock()
		if !queued { // running now: its call finishes and reports
			if err := <-j.result; err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
				return Result{}, err
			}
		}
		return Result{}, ctx.Err()
	}
}

// runAlone runs j whole on the caller's goroutine (no batching).
func (s *Scheduler) runAlone(j *job) (Result, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return Result{}, ErrClosed
	}
	s.alone.Add(1)
	s.mu.Unlock()
	defer s.alone.Done()
	if err := j.ctx.Err(); err != nil {
		return Result{}, err
	}
	err := s.forward([]piece{{j: j, rows: j.n}})
	s.mu.Lock()
	s.stats.Calls++
	if j.w.Sample != nil {
		s.stats.SampleCalls++
		if err == nil {
			s.stats.Sampled++
		}
	}
	s.stats.Sessions++
	s.stats.Rows += int64(j.n)
	s.stats.MaxSessions = max(s.stats.MaxSessions, 1)
	s.mu.Unlock()
	if err != nil {
		return Result{}, err
	}
	return j.res, nil
}

// actDType reports whether dt can carry activations in and out of a stack.
func actDType(dt native.DType) bool { return dt == native.F32 || dt == native.BF16 }

func (s *Scheduler) signal() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// remove takes j out of the queue; false when it is not there (running or done).
func (s *Scheduler) remove(j *job) bool {
	for i, q := range s.queue {
		if q == j {
			s.queue = append(s.queue[:i], s.queue[i+1:]...)
			return true
		}
	}
	return false
}

// runHere runs the next call on the submitting goroutine when the stack is
// idle and no linger is due (one session stepping alone): on an idle node
// that saves a hop two goroutine hand-offs. It reports false, leaving the
// work to the scheduler's goroutine, when the stack is busy or the recent
// calls held several sessions (they may be worth waiting for).
func (s *Scheduler) runHere() bool {
	if !s.running.TryLock() {
		return false
	}
	if distinct(s.lastSessions, s.beforeSessions) > 1 {
		s.running.Unlock()
		return false
	}
	if batch := s.take(); batch != nil {
		s.call(batch) // (run signals the goroutine for what queued meanwhile)
	}
	s.running.Unlock()
	return true
}

func (s *Scheduler) loop() {
	defer close(s.done)
	for {
		select {
		case <-s.stop:
			return
		case <-s.wake:
		}
		s.running.Lock()
		for {
			if want := distinct(s.lastSessions, s.beforeSessions); want > 1 {
				s.linger(want, s.took)
			}
			batch := s.take()
			if batch == nil {
				// The sessions of the last two calls: streams that arrived
				// apart would otherwise stay in two groups that take turns.
				clear(s.lastSessions)
				clear(s.beforeSessions)
				s.lastSessions, s.beforeSessions = s.lastSessions[:0], s.beforeSessions[:0]
				break
			}
			s.call(batch)
		}
		s.running.Unlock()
	}
}

// call runs one batch and remembers its sessions; s.running is held.
func (s *Scheduler) call(batch []piece) {
	start := time.Now()
	s.run(batch)
	s.took = time.Since(start)
	if s.cfg.OnCall != nil {
		rows := 0
		for _, p := range batch {
			rows += p.rows
		}
		s.cfg.OnCall(len(batch), rows, s.took)
	}
	// the two lists trade places: no allocation per call
	s.beforeSessions, s.lastSessions = s.lastSessions, s.beforeSessions[:0]
	for _, p := range batch {
		s.lastSessions = append(s.lastSessions, p.j.w.Session)
	}
}

// distinct counts the sessions in a and b.
func distinct(a, b []native.Session) int {
	n := len(a)
	for _, x := range b {
		if !slices.Contains(a, x) {
			n++
		}
	}
	return n
}

// linger waits, within Config.Linger of a call that took took, for want
// jobs to be queued.
func (s *Scheduler) linger(want int, took time.Duration) {
	wait := s.cfg.Linger
	if wait < 0 {
		return
	}
	if wait == 0 {
		wait = min(took/8, 50*time.Millisecond)
	}
	deadline := time.Now().Add(wait)
	for {
		s.mu.Lock()
		n := len(s.queue)
		s.mu.Unlock()
		if n >= want || n >= s.cfg.MaxBatch || !time.Now().Before(deadline) {
			return
		}
		select {
		case <-s.stop:
			return
		case <-s.wake:
		case <-time.After(time.Until(deadline)):
		}
	}
}

// piece is one job's share of a call.
type piece struct {
	j    *job
	from int // first row of the job
	rows int
}

// take removes the next call's work from the queue: oldest first, a session
// at most once, within MaxBatch and MaxRows, of the oldest work's Stage and
// kind (one Forward call runs one range in one dtype; a sampling call is
// one native.Ends call; the others wait their turn). A
// job with rows left after its piece goes back to the end of the queue when
// the call is done.
func (s *Scheduler) take() []piece {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	var batch []piece
	rows := 0
	inCall := map[native.Session]bool{}
	kept := s.queue[:0]
	for _, j := range s.queue {
		if j.ctx.Err() != nil {
			j.result <- j.ctx.Err()
			continue
		}
		left := min(j.n-j.next, s.cfg.PrefillChunk)
		if len(batch) >= s.cfg.MaxBatch || inCall[j.w.Session] || (rows > 0 && rows+left > s.cfg.MaxRows) ||
			(len(batch) > 0 && (j.stage != batch[0].j.stage || (j.w.Sample != nil) != (batch[0].j.w.Sample != nil))) {
			kept = append(kept, j)
			continue
		}
		inCall[j.w.Session] = true
		batch = append(batch, piece{j: j, from: j.next, rows: left})
		rows += left
	}
	for i := len(kept); i < len(s.queue); i++ {
		s.queue[i] = nil
	}
	s.queue = kept
	return batch
}

// run does one call and reports or requeues each piece's job. When the call
// fails, each piece runs alone, so one session's bad work (a position past
// its cache) fails only that session: the backend checks every step before
// it runs any.
func (s *Scheduler) run(batch []piece) {
	errs := make([]error, len(batch))
	calls := 1
	if err := s.forward(batch); err != nil {
		if len(batch) == 1 {
			errs[0] = err
		} else {
			for i := range batch {
				errs[i] = s.forward(batch[i : i+1])
			}
			calls += len(batch)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stats.Calls += int64(calls)
	s.stats.Sessions += int64(len(batch))
	if batch[0].j.w.Sample != nil {
		s.stats.SampleCalls += int64(calls)
	}
	s.stats.MaxSessions = max(s.stats.MaxSessions, len(batch))
	for i, p := range batch {
		s.stats.Rows += int64(p.rows)
		j := p.j
		if errs[i] != nil {
			j.result <- errs[i]
			continue
		}
		j.next += p.rows
		switch {
		case j.next == j.n:
			if j.w.Sample != nil {
				s.stats.Sampled++
			}
			j.result <- nil
		case s.closed:
			j.result <- ErrClosed
		case j.ctx.Err() != nil:
			j.result <- j.ctx.Err()
		default:
			s.queue = append(s.queue, j) // the next chunk waits its turn
		}
	}
	if len(s.queue) > 0 {
		s.signal()
	}
}

// forward runs the pieces, all of one Stage, as one Embed per token piece,
// one Forward, and one Logits call for the rows that want logits; sampling
// pieces as one native.Ends call.
func (s *Scheduler) forward(batch []piece) error {
	if batch[0].j.w.Sample != nil {
		return s.forwardSampling(batch)
	}
	stage := batch[0].j.stage
	dt := stage.DType
	row := s.hidden * dt.Size()
	act, inPlace, err := s.gather(batch, dt)
	if err != nil {
		return err
	}
	steps := make([]native.Step, len(batch))
	for i, p := range batch {
		w := p.j.w
		steps[i] = native.Step{Session: w.Session, Pos: w.Pos + p.from, NTokens: p.rows, Parents: w.Parents}
	}
	if err := s.st.Forward(steps, stage.First, stage.Last, dt, act, act); err != nil {
		return err
	}
	// the rows that want logits, in one head call: every row of a verify
	// pass, the last row of a finished job otherwise
	type head struct {
		j    *job
		rows int
	}
	var heads []head
	var headRows []byte
	nHead := 0
	off := 0
	for _, p := range batch {
		out := act[off*row : (off+p.rows)*row]
		off += p.rows
		switch {
		case !p.j.w.Logits:
		case p.j.w.EveryRow:
			heads = append(heads, head{p.j, p.rows})
			headRows = append(headRows, out...)
			nHead += p.rows
		case p.from+p.rows == p.j.n:
			heads = append(heads, head{p.j, 1})
			headRows = append(headRows, out[len(out)-row:]...)
			nHead++
		}
	}
	var logits []float32
	if nHead > 0 {
		logits = make([]float32, nHead*s.vocab)
		if err := s.st.Logits(nHead, dt, headRows, logits); err != nil {
			return err
		}
	}
	// all went well: hand the rows over (a failed call changes no job)
	off = 0
	for _, p := range batch {
		j := p.j
		if !j.w.Logits {
			if inPlace {
				j.res.Acts = act
			} else {
				if j.acts == nil {
					j.acts = make([]byte, 0, j.n*row)
				}
				j.acts = append(j.acts, act[off*row:(off+p.rows)*row]...)
				if p.from+p.rows == j.n {
					j.res.Acts = j.acts
				}
			}
		}
		off += p.rows
	}
	off = 0
	for _, h := range heads {
		l := logits[off*s.vocab : (off+h.rows)*s.vocab : (off+h.rows)*s.vocab]
		off += h.rows
		if !h.j.w.EveryRow {
			h.j.res.Logits = l
			continue
		}
		if h.j.logits == nil && len(l) == h.j.n*s.vocab { // the whole pass in one call
			h.j.logits = l
		} else {
			h.j.logits = append(h.j.logits, l...)
		}
		h.j.res.Logits = h.j.logits
	}
	return nil
}

// gather returns the call's input rows in dt. A call of one whole
// activations job reads the caller's rows in place (no copy: a node's hop
// buffer may be pinned host memory); any other call gathers its pieces'
// rows, embedded or copied, into a buffer of its own.
func (s *Scheduler) gather(batch []piece, dt native.DType) (act []byte, inPlace bool, err error) {
	row := s.hidden * dt.Size()
	total := 0
	for _, p := range batch {
		total += p.rows
	}
	if p := batch[0]; len(batch) == 1 && p.from == 0 && p.rows == p.j.n && p.j.w.Acts != nil {
		return p.j.w.Acts[:total*row], true, nil
	}
	act = make([]byte, total*row)
	off := 0
	for _, p := range batch {
		dst := act[off*row : (off+p.rows)*row]
		if w := p.j.w; w.Tokens != nil {
			if err := s.st.Embed(w.Tokens[p.from:p.from+p.rows], dt, dst); err != nil {
				return nil, false, err
			}
		} else {
			copy(dst, w.Acts[p.from*row:(p.from+p.rows)*row])
		}
		off += p.rows
	}
	return act, false, nil
}

// forwardSampling runs sampling pieces, all of one Stage, as one Decode
// (every piece's rows are ids and the stage is the whole stack in f32: the
// backend embeds them) or one TailForward on their rows (ids embedded here,
// into the call's buffer, in the stage's dtype), which samples each
// piece's last row in the backend. Every chunk of a long prompt runs so,
// not only the last: the backend records a step's ids in the session's
// token history only in these calls, and the last chunk's penalties need
// the whole prompt. An earlier chunk's draw is greedy and thrown away; the
// next chunk's ids overwrite it in the history.
func (s *Scheduler) forwardSampling(batch []piece) error {
	stage := batch[0].j.stage
	dt := stage.DType
	sc := s.st.Config()
	steps := make([]native.TokenStep, len(batch))
	tokensOnly := true
	for i, p := range batch {
		w := p.j.w
		ids := w.Tokens
		if ids == nil {
			ids, tokensOnly = w.Sample.Tokens, false
		}
		steps[i] = native.TokenStep{Session: w.Session, Pos: w.Pos + p.from, Tokens: ids[p.from : p.from+p.rows]}
		if p.from+p.rows == p.j.n {
			steps[i].Params, steps[i].GeneratedFrom, steps[i].Draw = w.Sample.Params, w.Sample.GeneratedFrom, w.Sample.Draw
		}
	}
	var choices []sample.Choice
	var err error
	if tokensOnly && dt == native.F32 && stage.First == sc.First {
		choices, err = s.ends.Decode(steps)
	} else {
		var act []byte
		if act, _, err = s.gather(batch, dt); err != nil { // in place: the call reads it only
			return err
		}
		choices, err = s.ends.TailForward(steps, stage.First, dt, act)
	}
	if err != nil {
		return err
	}
	for i, p := range batch {
		if p.from+p.rows == p.j.n {
			p.j.res.Choice = choices[i]
		}
	}
	return nil
}
