package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"time"

	"meshgpu/engine"
	"meshgpu/native"
)

// PerplexityConfig sizes the perplexity suite.
type PerplexityConfig struct {
	// Backend runs Model. Base always computes in f32 on the CPU backend
	// (this one when it is the CPU backend, else a CPU backend of its own).
	Backend BackendConfig
	// Model is the model scored.
	Model ModelSource
	// Base, when set, is the reference the model's next-token distributions
	// are compared with (mean KL divergence, same top token). It must share
	// the model's tokenizer.
	Base ModelSource
	// File is the text scored, tokenized whole.
	File string
	// Ctx is the chunk length in tokens (default 128): even, at least 4.
	Ctx int
}

// Series of the perplexity suite: one row per model, x = ctx, times per chunk.
const (
	SeriesPPLModel = "model"
	SeriesPPLBase  = "kl-base"
)

// PerplexityReport is the suite's table (Report) plus its quality numbers at
// the top level of the JSON. The base's fields are null without a base.
type PerplexityReport struct {
	*Report
	Model       string   `json:"model"`
	Base        string   `json:"base,omitempty"`
	File        string   `json:"file"`
	Backend     string   `json:"backend"`
	BaseBackend string   `json:"base_backend,omitempty"`
	Ctx         int      `json:"ctx"`
	Tokens      int      `json:"tokens"` // the whole text's, BOS included
	Chunks      int      `json:"chunks"`
	Scored      int      `json:"scored"` // positions scored, all chunks
	PPL         float64  `json:"ppl"`
	PPLErr      float64  `json:"ppl_err"` // one standard error
	BasePPL     *float64 `json:"base_ppl"`
	MeanKLD     *float64 `json:"mean_kld"`
	KLDErr      *float64 `json:"kld_err"`
	SameTopPct  *float64 `json:"same_top_pct"`
	ElapsedS    float64  `json:"elapsed_s"`
}

// WriteJSON writes the report, its quality numbers included, as indented JSON.
func (r *PerplexityReport) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// Perplexity scores a text the way llama.cpp's llama-perplexity does, so the
// numbers compare with the community's: the text is tokenized once (BOS
// added as the tokenizer adds it) and cut into whole chunks of Ctx tokens;
// each chunk runs from an empty KV cache with BOS in place of its first
// token, and only its second half is scored (positions Ctx/2 to Ctx-2, each
// predicting the next token), so every scored token sees at least Ctx/2
// tokens of context. ppl is exp of the mean negative log-likelihood over all
// scored positions. With a base, the same positions also give the mean KL
// divergence of the model's distribution from the base's and the percentage
// where both put the same token on top.
func Perplexity(ctx context.Context, cfg PerplexityConfig) (*PerplexityReport, error) {
	t0 := time.Now()
	if cfg.Ctx == 0 {
		cfg.Ctx = 128
	}
	if cfg.Ctx < 4 || cfg.Ctx%2 != 0 || cfg.Ctx > 1<<16 {
		return nil, fmt.Errorf("--ctx %d: the chunk length must be even and 4 to 65536 (llama.cpp's usual is 512; 128 for a small model)", cfg.Ctx)
	}
	if cfg.Model.Dir == "" && cfg.Model.Synth == "" {
		return nil, fmt.Errorf("no model: pass --model DIR (or --synth SHAPE)")
	}
	if cfg.File == "" {
		return nil, fmt.Errorf("no text: pass --file TEXT, the text to score")
	}
	text, err := os.ReadFile(cfg.File)
	if err != nil {
		return nil, fmt.Errorf("--file: %w", err)
	}
	dir, err := cfg.Model.Resolve(ctx)
	if err != nil {
		return nil, err
	}
	be, err := cfg.Backend.open()
	if err != nil {
		return nil, err
	}
	defer be.Close()
	// Activations in the dtype the backend computes in, as a node serves:
	// f32 on CPU (f32 arithmetic throughout), bf16 on CUDA.
	dt := native.F32
	if be.Name() == "cuda" {
		dt = native.BF16
	}
	m, err := loadPPLModel(dir, be, dt, cfg.Ctx)
	if err != nil {
		return nil, err
	}
	defer m.close()

	tokens := m.m.Tokenizer.Encode(string(text), true)
	chunks := len(tokens) / cfg.Ctx
	if chunks == 0 {
		return nil, fmt.Errorf("--file %s: %d tokens, fewer than one chunk of --ctx %d: use a longer text or a smaller --ctx", cfg.File, len(tokens), cfg.Ctx)
	}
	// The BOS swap follows the tokenizer: only one that adds BOS gets it
	// at the start of every chunk.
	bos, addsBOS := m.m.Tokenizer.BOS()
	addsBOS = addsBOS && tokens[0] == bos

	var base *pplModel
	baseDir := ""
	if cfg.Base.Dir != "" || cfg.Base.Synth != "" {
		// A directory goes straight to the loader, whose errors name it
		// (Resolve's would say --model).
		baseDir = cfg.Base.Dir
		if baseDir == "" {
			if baseDir, err = cfg.Base.Resolve(ctx); err != nil {
				return nil, fmt.Errorf("--kl-base: %w", err)
			}
		}
		bbe := be
		if be.Name() != "cpu" {
			if bbe, err = (BackendConfig{Name: "cpu", Threads: cfg.Backend.Threads, CPUISA: cfg.Backend.CPUISA}).open(); err != nil {
				return nil, fmt.Errorf("--kl-base: %w", err)
			}
			defer bbe.Close()
		}
		// f32 activations in steps shorter than native.PromptStepMin take
		// decode's products, which give the same bits however a chunk is
		// split; on the f32 path (runBase below) they are f32 products.
		if base, err = loadPPLModel(baseDir, bbe, native.F32, cfg.Ctx); err != nil {
			return nil, fmt.Errorf("--kl-base: %w", err)
		}
		base.exact = true
		defer base.close()
		if err := sameTokenizer(m, base, string(text), tokens); err != nil {
			return nil, fmt.Errorf("--kl-base %s: %w", baseDir, err)
		}
	}

	first := cfg.Ctx / 2
	var sc scorer
	var baseScore scorer
	chunk := make([]int32, cfg.Ctx)
	for c := 0; c < chunks; c++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		copy(chunk, tokens[c*cfg.Ctx:(c+1)*cfg.Ctx])
		if addsBOS {
			chunk[0] = bos
		}
		if err := m.run(chunk, first); err != nil {
			return nil, fmt.Errorf("chunk %d: %w", c, err)
		}
		if base != nil {
			if err := runBase(base, chunk, first); err != nil {
				return nil, fmt.Errorf("--kl-base: chunk %d: %w", c, err)
			}
		}
		for j := first; j <= cfg.Ctx-2; j++ {
			r := j - first
			var bl []float32
			if base != nil {
				bl = base.row(r)
				if !baseScore.add(bl, nil, chunk[j+1]) {
					return nil, fmt.Errorf("--kl-base: chunk %d, position %d: the base's logits are not finite", c, j)
				}
			}
			if !sc.add(m.row(r), bl, chunk[j+1]) {
				return nil, fmt.Errorf("chunk %d, position %d: the model's logits are not finite", c, j)
			}
		}
	}

	rep := &PerplexityReport{Model: dir, File: cfg.File, Backend: be.Name(), Ctx: cfg.Ctx, Tokens: len(tokens),
		Chunks: chunks, Scored: sc.n}
	rep.PPL, rep.PPLErr = sc.ppl()
	baseline := "none (no --kl-base)"
	if base != nil {
		rep.Base, rep.BaseBackend = baseDir, base.backend
		bp, _ := baseScore.ppl()
		kld, kerr := sc.meanKLD()
		same := sc.sameTopPct()
		rep.BasePPL, rep.MeanKLD, rep.KLDErr, rep.SameTopPct = &bp, &kld, &kerr, &same
		baseline = fmt.Sprintf("--kl-base %s, f32 on %s", baseDir, base.backend)
	}
	rep.Report = NewReport("perplexity", "ctx", "ms/chunk", baseline)
	extra := map[string]float64{"ppl": rep.PPL, "ppl_err": rep.PPLErr}
	if base != nil {
		extra["mean_kld"], extra["same_top_pct"] = *rep.MeanKLD, *rep.SameTopPct
	}
	rep.Add(SeriesPPLModel, float64(cfg.Ctx), m.times, extra)
	if base != nil {
		rep.Add(SeriesPPLBase, float64(cfg.Ctx), base.times, map[string]float64{"ppl": *rep.BasePPL})
	}
	rep.Notes = append(rep.Notes,
		fmt.Sprintf("model %s on %s (%s), %s activations", dir, be.Name(), be.Describe(), dt),
		fmt.Sprintf("text %s: %d tokens, %d chunks of %d (BOS first: %v), positions %d-%d of each scored: %d in all",
			cfg.File, len(tokens), chunks, cfg.Ctx, addsBOS, first, cfg.Ctx-2, sc.n),
		fmt.Sprintf("ppl %.4f ± %.4f", rep.PPL, rep.PPLErr))
	if base != nil {
		rep.Notes = append(rep.Notes, fmt.Sprintf("vs --kl-base: mean KL divergence %.6g ± %.2g, same top token %.3f%%; base ppl %.4f",
			*rep.MeanKLD, *rep.KLDErr, *rep.SameTopPct, *rep.BasePPL))
	}
	rep.ElapsedS = time.Since(t0).Seconds()
	return rep, nil
}

// pplModel is one model of the suite on its stack, with a session and the
// buffers one chunk needs.
type pplModel struct {
	m       *engine.Model
	backend string
	sess    native.Session
	dt      native.DType
	vocab   int
	act     []byte
	logits  []float32 // the scored rows' logits, vocab apart
	times   []float64 // ms per chunk
	exact   bool      // steps shorter than native.PromptStepMin: f32 products on every CPU path (the --kl-base)
}

func loadPPLModel(dir string, be native.Backend, dt native.DType, ctxLen int) (*pplModel, error) {
	m, err := engine.Load(dir, engine.Options{Backend: be, First: 0, Last: -1, MaxContext: ctxLen})
	if err != nil {
		return nil, err
	}
	if m.Tokenizer == nil {
		m.Close()
		return nil, fmt.Errorf("%s: no tokenizer", dir)
	}
	sess, err := m.Stack.NewSession(ctxLen)
	if err != nil {
		m.Close()
		return nil, err
	}
	vocab := m.Stack.Config().Vocab
	scored := ctxLen - 1 - ctxLen/2
	return &pplModel{m: m, backend: be.Name(), sess: sess, dt: dt, vocab: vocab,
		act: make([]byte, ctxLen*m.Config.Hidden*dt.Size()), logits: make([]float32, scored*vocab)}, nil
}

func (p *pplModel) close() {
	p.sess.Close()
	p.m.Close()
}

// run computes the logits of rows first..len(chunk)-2 of chunk. Position 0
// truncates the session, so every chunk starts from an empty KV cache.
func (p *pplModel) run(chunk []int32, first int) error {
	t0 := time.Now()
	n := len(chunk)
	row := len(p.act) / n
	stage := []engine.Stage{{Stack: p.m.Stack, Session: p.sess, First: p.m.First, Last: p.m.Last}}
	piece := n
	if p.exact {
		piece = native.PromptStepMin - 1
	}
	for pos := 0; pos < n; pos += piece {
		k := min(piece, n-pos)
		if err := engine.RunStep(stage, pos, k, chunk[pos:pos+k], p.dt, p.act[pos*row:(pos+k)*row], nil); err != nil {
			return err
		}
	}
	// The LM head on the scored rows only: the first half is never scored.
	if err := p.m.Stack.Logits(n-1-first, p.dt, p.act[first*row:], p.logits); err != nil {
		return err
	}
	p.times = append(p.times, float64(time.Since(t0).Nanoseconds())/1e6)
	return nil
}

// row is the logits of scored row r (position first+r) of the last chunk run.
func (p *pplModel) row(r int) []float32 { return p.logits[r*p.vocab : (r+1)*p.vocab] }

// sameTokenizer checks that the base can stand for the model: the same
// vocabulary size and the same ids for the text.
func sameTokenizer(m, base *pplModel, text string, tokens []int32) error {
	if base.vocab != m.vocab {
		return fmt.Errorf("vocabulary of %d tokens, the model's has %d: the base must share the model's tokenizer", base.vocab, m.vocab)
	}
	bt := base.m.Tokenizer.Encode(text, true)
	for i := range min(len(bt), len(tokens)) {
		if bt[i] != tokens[i] {
			return fmt.Errorf("tokenizes the text differently from the model (token %d: id %d, the model's %d): the base must share the model's tokenizer", i, bt[i], tokens[i])
		}
	}
	if len(bt) != len(tokens) {
		return fmt.Errorf("tokenizes the text to %d tokens, the model to %d: the base must share the model's tokenizer", len(bt), len(tokens))
	}
	return nil
}

// scorer sums what the scored positions contribute. Everything is float64:
// a mean over thousands of positions of log-probabilities near zero.
type scorer struct {
	n         int
	nll, nll2 float64 // sums of -log p(next token) and of its square
	kld, kld2 float64
	sameTop   int
	lp, lb    []float64 // log-softmax scratch: model, base
}

// add scores one position: logits predict next. With base logits it also
// adds the KL divergence of the model's distribution from the base's and
// whether their top tokens agree. It reports false when the result is not
// finite (NaN or infinite logits), leaving the sums as they were.
func (s *scorer) add(logits, base []float32, next int32) bool {
	s.lp = logSoftmax(logits, s.lp)
	nll := -s.lp[next]
	if math.IsNaN(nll) || math.IsInf(nll, 0) {
		return false
	}
	var kld float64
	if base != nil {
		s.lb = logSoftmax(base, s.lb)
		for v, lb := range s.lb {
			if pb := math.Exp(lb); pb > 0 { // 0 log 0 counts as 0
				kld += pb * (lb - s.lp[v])
			}
		}
		if math.IsNaN(kld) || math.IsInf(kld, 0) {
			return false
		}
		if argmax(logits) == argmax(base) {
			s.sameTop++
		}
	}
	s.n++
	s.nll += nll
	s.nll2 += nll * nll
	s.kld += kld
	s.kld2 += kld * kld
	return true
}

// ppl is exp(mean nll) and its standard error (the mean's, carried through exp).
func (s *scorer) ppl() (ppl, stderr float64) {
	mean, se := meanSE(s.nll, s.nll2, s.n)
	ppl = math.Exp(mean)
	return ppl, ppl * se
}

func (s *scorer) meanKLD() (mean, stderr float64) { return meanSE(s.kld, s.kld2, s.n) }

func (s *scorer) sameTopPct() float64 {
	if s.n == 0 {
		return 0
	}
	return 100 * float64(s.sameTop) / float64(s.n)
}

// meanSE is the mean of n values from their sum and sum of squares, and the
// mean's standard error (0 for fewer than two values).
func meanSE(sum, sum2 float64, n int) (mean, se float64) {
	if n == 0 {
		return 0, 0
	}
	mean = sum / float64(n)
	if n < 2 {
		return mean, 0
	}
	v := (sum2/float64(n) - mean*mean) * float64(n) / float64(n-1) // sample variance
	return mean, math.Sqrt(max(v, 0) / float64(n))
}

// logSoftmax returns log softmax(x) in float64, in out when it is large enough.
func logSoftmax(x []float32, out []float64) []float64 {
	if cap(out) < len(x) {
		out = make([]float64, len(x))
	}
	out = out[:len(x)]
	mx := math.Inf(-1)
	for _, v := range x {
		mx = max(mx, float64(v))
	}
	var sum float64
	for _, v := range x {
		sum += math.Exp(float64(v) - mx) // shifted by the max: no overflow
	}
	lse := mx + math.Log(sum)
	for i, v := range x {
		out[i] = float64(v) - lse
	}
	return out
}

// argmax is the index of the largest value, the first of equals.
func argmax(x []float32) int {
	best := 0
	for i, v := range x {
		if v > x[best] {
			best = i
		}
	}
	return best
}

// runBase runs the --kl-base model's chunk with f32 products
// (native.F32Products: the default may be avx512bf16's bf16 products).
func runBase(base *pplModel, chunk []int32, first int) error {
	restore, err := native.F32Products()
	if err != nil {
		return err
	}
	defer restore()
	return base.run(chunk, first)
}
