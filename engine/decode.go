package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"meshgpu/model/tokenizer"
	"meshgpu/native"
	"meshgpu/sample"
)

// Stepper feeds tokens at positions pos..pos+len(tokens)-1 through the whole
// model and returns the sampled next token. step is the index of the token
// being generated (0 for the first), which seeds its draw.
type Stepper func(ctx context.Context, pos int, tokens []int32, step int) (id int32, logprob float32, err error)

// MultiStepper is a Stepper that may return several tokens: the next one
// and, with speculative decoding, the ones after it that a single pass
// verified. It returns 1 to limit tokens, generated as steps step,
// step+1, ...
type MultiStepper func(ctx context.Context, pos int, tokens []int32, step, limit int) ([]sample.Draw, error)

// Multi is s as a MultiStepper (one token per pass).
func (s Stepper) Multi() MultiStepper {
	return func(ctx context.Context, pos int, tokens []int32, step, _ int) ([]sample.Draw, error) {
		id, lp, err := s(ctx, pos, tokens, step)
		if err != nil {
			return nil, err
		}
		return []sample.Draw{{ID: id, Logprob: lp}}, nil
	}
}

// GenerateParams are the per-request settings of Decode.
type GenerateParams struct {
	MaxTokens int
	Sampling  sample.Params
	Stop      []string
	IgnoreEOS bool
	// Resume holds the ids an earlier, failed attempt already generated and
	// streamed; they end the prompt. The stream decoder and the stop-string
	// search start from them, so text the earlier attempt held back (bytes of
	// an incomplete character, a possible stop-string prefix) is streamed
	// with the next token, as in an uninterrupted run. Result.IDs and Text
	// then hold only what this call adds.
	Resume []int32
}

// Limits on GenerateParams, so a request cannot ask for unbounded work.
const (
	MaxStopStrings   = 16
	MaxStopStringLen = 256
)

// Validate checks the parameters.
func (p GenerateParams) Validate() error {
	if p.MaxTokens <= 0 {
		return fmt.Errorf("max tokens %d must be > 0", p.MaxTokens)
	}
	if len(p.Stop) > MaxStopStrings {
		return fmt.Errorf("%d stop strings, at most %d", len(p.Stop), MaxStopStrings)
	}
	for _, s := range p.Stop {
		if s == "" || len(s) > MaxStopStringLen {
			return fmt.Errorf("stop strings must be 1..%d bytes, got %d", MaxStopStringLen, len(s))
		}
	}
	return p.Sampling.Validate()
}

// Token is one streamed piece of output.
type Token struct {
	// ID is the generated token, or -1 for the final piece of text held back
	// while it might have begun a stop string (or an incomplete character).
	ID int32
	// Text is the UTF-8-safe delta, possibly empty: every generated token is
	// reported, but text that may start a stop string (or an incomplete
	// character) is held back, and a stop string itself is never streamed.
	Text    string
	Logprob float32
}

// Result is a finished generation.
type Result struct {
	IDs                            []int32
	Text                           string // truncated before the stop string
	FinishReason                   string // "stop" (EOS or stop string) or "length"
	PromptTokens, CompletionTokens int
	PrefillTime, DecodeTime        time.Duration
	// EOS: an end-of-text token, EOSID, ended it (its step is the one
	// after IDs).
	EOS   bool
	EOSID int32
}

// Finish reasons.
const (
	FinishStop   = "stop"
	FinishLength = "length"
)

// Decode runs the generation loop with any Stepper: the prompt in one step,
// then one token per step. It stops on EOS (unless IgnoreEOS), a stop string
// (the text is cut before it, and it is never streamed), MaxTokens, or ctx
// (returning the partial result with ctx's error). onToken, when not nil,
// receives the streamed deltas; its error ends the generation.
func Decode(ctx context.Context, tok *tokenizer.Tokenizer, eos []int32, prompt []int32, p GenerateParams, next Stepper, onToken func(Token) error) (*Result, error) {
	return DecodeMulti(ctx, tok, eos, prompt, p, next.Multi(), onToken)
}

// DecodeMulti is Decode with a stepper that may return several tokens per
// pass; each is handled as if it came from its own step (EOS, stop
// strings and MaxTokens end the generation at that token, and the rest of
// the pass is dropped).
func DecodeMulti(ctx context.Context, tok *tokenizer.Tokenizer, eos []int32, prompt []int32, p GenerateParams, next MultiStepper, onToken func(Token) error) (*Result, error) {
	if tok == nil {
		return nil, errors.New("decode: no tokenizer")
	}
	if len(prompt) == 0 {
		return nil, errors.New("decode: empty prompt")
	}
	if err := p.Validate(); err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	res := &Result{PromptTokens: len(prompt)}
	emit := func(t Token) error {
		if onToken == nil || (t.Text == "" && t.ID < 0) {
			return nil
		}
		return onToken(t)
	}
	dec := tok.NewStreamDecoder(true)
	var text strings.Builder // all decoded text so far
	sent := 0                // bytes of text already streamed
	// Replay what the earlier attempt streamed: its text counts as sent up
	// to where that attempt stopped holding back.
	for _, id := range p.Resume {
		text.WriteString(dec.Add(id))
		s := text.String()
		sent = max(sent, len(s)-holdBack(s, p.Stop))
	}
	resumed := sent // bytes streamed by the earlier attempt

	// finish completes res; with flush it streams the text still held back.
	finish := func(reason string, flush bool) (*Result, error) {
		full := text.String() + dec.Flush()
		cut, stopped := findStop(full, p.Stop, sent)
		if stopped {
			reason = FinishStop
			full = full[:cut]
		}
		res.Text = full[min(resumed, len(full)):]
		res.FinishReason = reason
		res.CompletionTokens = len(res.IDs)
		if flush && len(full) > sent {
			if err := emit(Token{ID: -1, Text: full[sent:]}); err != nil {
				return res, err
			}
		}
		return res, nil
	}

	var pending []sample.Draw
	pass := func(pos int, tokens []int32, step int) error {
		var err error
		pending, err = next(ctx, pos, tokens, step, p.MaxTokens-len(res.IDs))
		if err == nil && (len(pending) == 0 || len(pending) > p.MaxTokens-len(res.IDs)) {
			err = fmt.Errorf("decode: a pass returned %d tokens, want 1 to %d", len(pending), p.MaxTokens-len(res.IDs))
		}
		return err
	}
	start := time.Now()
	err := pass(0, prompt, 0)
	res.PrefillTime = time.Since(start)
	if err != nil {
		return res, err
	}
	decodeStart := time.Now()
	defer func() { res.DecodeTime = time.Since(decodeStart) }()
	for step := 0; ; step++ {
		id, lp := pending[0].ID, pending[0].Logprob
		pending = pending[1:]
		if !p.IgnoreEOS && slices.Contains(eos, id) {
			res.EOS, res.EOSID = true, id
			return finish(FinishStop, true)
		}
		res.IDs = append(res.IDs, id)
		text.WriteString(dec.Add(id))
		s := text.String()
		if cut, ok := findStop(s, p.Stop, sent); ok {
			// the stop string ends the output; text before it is sent
			if cut > sent {
				if err := emit(Token{ID: id, Text: s[sent:cut], Logprob: lp}); err != nil {
					return res, err
				}
				sent = cut
			}
			text.Reset()
			text.WriteString(s[:cut])
			dec = tok.NewStreamDecoder(true) // nothing after the stop matters
			return finish(FinishStop, true)
		}
		safe := len(s) - holdBack(s, p.Stop)
		if safe < sent {
			safe = sent
		}
		if err := emit(Token{ID: id, Text: s[sent:safe], Logprob: lp}); err != nil {
			return res, err
		}
		sent = safe
		if len(res.IDs) >= p.MaxTokens {
			return finish(FinishLength, true)
		}
		if err := ctx.Err(); err != nil {
			r, _ := finish(FinishLength, false) // the caller reports the error
			return r, err
		}
		if len(pending) > 0 {
			continue
		}
		if err := pass(len(prompt)+step, []int32{id}, step+1); err != nil {
			r, _ := finish(FinishLength, false) // the caller reports the error
			return r, err
		}
	}
}

// findStop returns where the earliest stop string begins in s, looking only
// at occurrences that end after byte from (earlier text was already checked).
func findStop(s string, stops []string, from int) (int, bool) {
	best, found := len(s), false
	for _, st := range stops {
		lo := from - len(st) + 1
		if lo < 0 {
			lo = 0
		}
		if i := strings.Index(s[lo:], st); i >= 0 && lo+i < best {
			best, found = lo+i, true
		}
	}
	return best, found
}

// holdBack is the length of the longest suffix of s that is a proper prefix
// of some stop string: that text may still become a stop string.
func holdBack(s string, stops []string) int {
	n := 0
	for _, st := range stops {
		for k := min(len(st)-1, len(s)); k > n; k-- {
			if strings.HasSuffix(s, st[:k]) {
				n = k
				break
			}
		}
	}
	return n
}

// LocalStepper runs a model holding all layers (embeddings to head) on one
// stack for one session, handing activations between embed, layers and head
// in hopDType (F32, or BF16 to mimic the mesh's wire format). The repetition
// penalty sees the prompt and the generated tokens.
func (m *Model) LocalStepper(sess native.Session, p sample.Params, hopDType native.DType) Stepper {
	var history []int32
	generatedFrom := 0 // the prompt's length: later ids are generated
	var act []byte
	logits := make([]float32, m.Config.Vocab)
	return func(ctx context.Context, pos int, tokens []int32, step int) (int32, float32, error) {
		if err := ctx.Err(); err != nil {
			return 0, 0, err
		}
		if !m.HasEmbed() || !m.HasHead() {
			return 0, 0, fmt.Errorf("local stepper: the model holds layers %d-%d, not all %d", m.First, m.Last, m.Config.NumLayers)
		}
		if len(tokens) == 0 || pos < 0 || pos > len(history) {
			return 0, 0, fmt.Errorf("local stepper: %d tokens at position %d (history %d)", len(tokens), pos, len(history))
		}
		row := m.Config.Hidden * hopDType.Size()
		n := len(tokens)
		if cap(act) < n*row {
			act = make([]byte, n*row)
		}
		act = act[:n*row]
		if err := RunStep([]Stage{{Stack: m.Stack, Session: sess, First: m.First, Last: m.Last}}, pos, n, tokens, hopDType, act, logits); err != nil {
			return 0, 0, err
		}
		history = append(history[:pos], tokens...)
		if pos == 0 {
			generatedFrom = len(tokens)
		}
		c := sample.Choose(logits, p, history, generatedFrom, step)
		return c.ID, c.Logprob, nil
	}
}

// DeviceStepper is LocalStepper through the backend's single-node call
// (native.Ends.Decode): tokens in, the sampled token out, the logits and
// the token history staying in the backend (device memory on CUDA). It
// computes what LocalStepper computes with an F32 hop on the CPU backend
// (tests compare). ok is false when the stack lacks the call. It is
// Model.Generate's, one session on a stack of its own; a node's ends and
// `meshgpu generate` make the same calls through their stack's scheduler
// (sched.Work.Sample), batched with other sessions.
func (m *Model) DeviceStepper(sess native.Session, p sample.Params) (st Stepper, ok bool) {
	ends, ok := m.Stack.(native.Ends)
	if !ok || !ends.HasEnds() || !m.HasEmbed() || !m.HasHead() {
		return nil, false
	}
	generatedFrom := 0
	return func(ctx context.Context, pos int, tokens []int32, step int) (int32, float32, error) {
		if err := ctx.Err(); err != nil {
			return 0, 0, err
		}
		if len(tokens) == 0 || pos < 0 {
			return 0, 0, fmt.Errorf("device stepper: %d tokens at position %d", len(tokens), pos)
		}
		if pos == 0 {
			generatedFrom = len(tokens)
		}
		c, err := ends.Decode([]native.TokenStep{{Session: sess, Pos: pos, Tokens: tokens, GeneratedFrom: generatedFrom,
			Draw: step, Params: p}})
		if err != nil {
			return 0, 0, err
		}
		return c[0].ID, c[0].Logprob, nil
	}, true
}

// Generate runs a whole generation on this model (which must hold all
// layers) in a new session sized for the prompt and MaxTokens.
func (m *Model) Generate(ctx context.Context, prompt []int32, p GenerateParams, onToken func(Token) error) (*Result, error) {
	if m.Tokenizer == nil {
		return nil, errors.New("generate: the model has no tokenizer")
	}
	if err := p.Validate(); err != nil {
		return nil, fmt.Errorf("generate: %w", err)
	}
	max := m.Stack.Config().MaxContext
	if len(prompt)+p.MaxTokens > max {
		return nil, fmt.Errorf("generate: %d prompt tokens + %d new tokens exceed the context of %d", len(prompt), p.MaxTokens, max)
	}
	sess, err := m.Stack.NewSession(len(prompt) + p.MaxTokens)
	if err != nil {
		return nil, err
	}
	defer sess.Close()
	step, ok := m.DeviceStepper(sess, p.Sampling)
	if !ok {
		step = m.LocalStepper(sess, p.Sampling, native.F32)
	}
	return Decode(ctx, m.Tokenizer, m.EOS(), prompt, p, step, onToken)
}
