package node

import (
	"context"
	"net/http"
	"time"

	"meshgpu/engine"
	"meshgpu/native"
	"meshgpu/openai"
	"meshgpu/sample"
	"meshgpu/wire"
)

// The OpenAI API of a head node. openai.ParseRequest validates a request the
// same way here and on the tracker; this file adds what needs the model
// (the model name, the template, the context) and generates.

func (s *Server) modelInfo() openai.Model {
	m := openai.Model{ID: s.ModelName, Object: "model", Created: s.started.Unix(), OwnedBy: "meshgpu", ContextLength: s.MaxContext}
	if !s.Variant.IsZero() {
		m.Meshgpu = &openai.ModelMeshgpu{Variants: []wire.Variant{s.Variant}}
	}
	return m
}

func (s *Server) handleModels(w http.ResponseWriter, r *http.Request) {
	w.Header().Set(openai.HeaderRequestID, openai.RequestID(r))
	writeJSON(w, http.StatusOK, openai.ModelList{Object: "list", Data: []openai.Model{s.modelInfo()}})
}

func (s *Server) handleModel(w http.ResponseWriter, r *http.Request) {
	w.Header().Set(openai.HeaderRequestID, openai.RequestID(r))
	if id := r.PathValue("id"); id != s.ModelName {
		wire.WriteError(w, openai.ModelNotFound(id))
		return
	}
	writeJSON(w, http.StatusOK, s.modelInfo())
}

func (s *Server) handleCompletions(w http.ResponseWriter, r *http.Request) {
	s.serveOpenAI(w, r, false)
}

func (s *Server) handleChatCompletions(w http.ResponseWriter, r *http.Request) {
	s.serveOpenAI(w, r, true)
}

// job is a validated OpenAI request: one or more prompts, n choices each.
type job struct {
	chat     bool
	stream   bool
	usage    bool // stream_options.include_usage
	logprobs bool
	echo     bool
	resumed  int // continue_ids at the end of the (single) prompt
	// speculate is the request's speculative decoding: the head's, unless
	// the request chose (meshgpu.speculate).
	speculate wire.SpeculateMode
	id        string
	created   int64
	arrived   time.Time
	choices   []*choice
	grant     *sessionGrant // the route ticket and session keys (node/tickets.go)
	// promptTokens counts each prompt once, however many choices it has.
	promptTokens int
	tools        *toolSyntax // nil: no tools offered
}

// choice is one generation of a job.
type choice struct {
	index  int
	prompt []int32
	echo   string // completions echo: the prompt's text, sent before the output
	params engine.GenerateParams

	// set after generation when tools were offered
	content   *string
	toolCalls []openai.ToolCall
}

func (s *Server) serveOpenAI(w http.ResponseWriter, r *http.Request, chatAPI bool) {
	endpoint := "completions"
	if chatAPI {
		endpoint = "chat.completions"
	}
	w.Header().Set(openai.HeaderRequestID, openai.RequestID(r))
	arrived := time.Now()
	s.metrics.waiting.Inc()
	waiting := true
	defer func() {
		if waiting {
			s.metrics.waiting.Dec()
		}
		s.metrics.reqLat.WithLabelValues(endpoint).Observe(time.Since(arrived).Seconds())
	}()
	j, ae := s.parseJob(w, r, chatAPI)
	if ae != nil {
		s.metrics.requestDone(endpoint, ae.Type)
		writeError(w, ae)
		return
	}
	j.arrived = arrived
	release, ae := s.admit.enter(r.Context(), s.metrics)
	if ae != nil {
		s.metrics.requestDone(endpoint, ae.Type)
		if ae.Status != 499 {
			writeError(w, ae)
		}
		return
	}
	defer release()
	headEnd, route, grant, ae := s.planSession(r.Context(), r.Header, len(j.choices))
	j.grant = grant
	if ae != nil {
		s.metrics.requestDone(endpoint, ae.Type)
		writeError(w, ae)
		return
	}
	s.metrics.waiting.Dec()
	waiting = false
	s.metrics.running.Inc()
	defer s.metrics.running.Dec()

	sse := &openai.SSEWriter{W: w}
	defer sse.End()
	out := make([]openai.Choice, len(j.choices))
	completion := 0
	for i, c := range j.choices {
		res, lps, ae := s.runChoice(r.Context(), sse, j, c, headEnd, route)
		if ae != nil {
			s.metrics.requestDone(endpoint, ae.Type)
			if ae.Status != 499 {
				if sse.Started() {
					sse.Event(errorBody{Error: ae.wire()})
				} else {
					writeError(w, ae)
				}
			}
			return
		}
		completion += res.CompletionTokens
		reason := res.FinishReason
		text := c.echo + res.Text
		out[i] = openai.Choice{Index: c.index, FinishReason: &reason}
		if j.logprobs {
			out[i].Logprobs = s.logprobsOf(j, res.IDs, lps, len(c.echo))
		}
		if chatAPI {
			out[i].Message = &openai.ChatMessage{Role: "assistant", Content: &text}
			if j.tools != nil && len(c.toolCalls) > 0 {
				calls := append([]openai.ToolCall(nil), c.toolCalls...)
				for k := range calls {
					calls[k].Index = nil // only stream deltas carry it
				}
				out[i].Message = &openai.ChatMessage{Role: "assistant", Content: c.content, ToolCalls: calls}
			}
		} else {
			out[i].Text = &text
		}
	}
	s.metrics.requestDone(endpoint, "ok")
	s.metrics.tokensCounted(j.promptTokens, completion)
	usage := &openai.Usage{PromptTokens: j.promptTokens, CompletionTokens: completion, TotalTokens: j.promptTokens + completion}
	if j.stream {
		if j.usage {
			c := s.chunk(j)
			c.Choices = []openai.Choice{}
			c.Usage = usage
			sse.Event(c)
		}
		sse.Done()
		return
	}
	c := openai.Completion{ID: j.id, Object: openai.Object(chatAPI, false), Created: j.created, Model: s.ModelName, Choices: out, Usage: usage}
	writeJSON(w, http.StatusOK, c)
}

// logprobsOf builds a choice's logprobs from the tail's per-token reports.
func (s *Server) logprobsOf(j *job, ids []int32, lps []sample.TokenLogprobs, offset int) any {
	tok := s.Model.Tokenizer
	piece := func(id int32) string { return tok.Decode([]int32{id}, false) }
	if j.chat {
		out := &openai.ChatLogprobs{Content: []openai.TokenLogprob{}}
		for i, id := range ids {
			if i >= len(lps) {
				break
			}
			t := piece(id)
			e := openai.TokenLogprob{Token: t, Logprob: float64(lps[i].Logprob), Bytes: openai.Bytes(t), TopLogprobs: []openai.TopLogprob{}}
			for _, c := range lps[i].Top {
				ct := piece(c.ID)
				e.TopLogprobs = append(e.TopLogprobs, openai.TopLogprob{Token: ct, Logprob: float64(c.Logprob), Bytes: openai.Bytes(ct)})
			}
			out.Content = append(out.Content, e)
		}
		return out
	}
	out := &openai.CompletionLogprobs{Tokens: []string{}, TokenLogprobs: []float64{}, TopLogprobs: []map[string]float64{}, TextOffset: []int{}}
	for i, id := range ids {
		if i >= len(lps) {
			break
		}
		t := piece(id)
		out.Tokens = append(out.Tokens, t)
		out.TokenLogprobs = append(out.TokenLogprobs, float64(lps[i].Logprob))
		top := map[string]float64{}
		for _, c := range lps[i].Top {
			if _, dup := top[piece(c.ID)]; !dup {
				top[piece(c.ID)] = float64(c.Logprob)
			}
		}
		out.TopLogprobs = append(out.TopLogprobs, top)
		out.TextOffset = append(out.TextOffset, offset)
		offset += len(t)
	}
	return out
}

// runChoice generates one choice; for a stream it writes its SSE events.
func (s *Server) runChoice(ctx context.Context, sse *openai.SSEWriter, j *job, c *choice, headEnd int, route []wire.Hop) (*engine.Result, []sample.TokenLogprobs, *apiError) {
	sessID := j.grant.sessionID(c.index, len(j.choices))
	sess, ae := s.sessions.getSized(sessID, 0, len(c.prompt)+c.params.MaxTokens)
	if ae != nil {
		return nil, nil, ae
	}
	if err := sess.acquire(ctx); err != nil {
		s.sessions.remove(sessID)
		return nil, nil, &apiError{Status: 499, Type: "canceled", Message: "request canceled"}
	}
	if sess.local.Load() || sess.key.Load() != nil || sess.binding != nil || sess.kv.Len() > 0 {
		sess.release()
		return nil, nil, &apiError{Status: http.StatusConflict, Type: "session_exists", Message: "session " + sessID + " is in use on this node"}
	}
	sess.local.Store(true) // driven here: no hop from the network touches it
	dtype := s.hopDType()
	if len(route) == 0 {
		dtype = native.F32 // no wire: keep full precision to the logits
	}
	p := &pipeline{s: s, sess: sess, id: sessID, headEnd: headEnd, route: route, ticket: j.grant.pass, params: c.params.Sampling, dtype: dtype, start: j.arrived,
		busyUntil: s.busyUntil(j), direct: s.directKey(j.grant, route),
		spec: s.newSpeculation(speculationFor(j.speculate, c.params.Sampling), len(c.prompt)+c.params.MaxTokens)}
	failed := false
	defer func() {
		p.spec.close()
		p.closeChains()
		sess.release()
		s.sessions.remove(sessID)
		if len(route) == 0 {
			return
		}
		// The client may be gone; free the session on every hop anyway.
		free := func() { s.deleteSessions(context.WithoutCancel(ctx), route, sessID, j.grant.keys) }
		if failed {
			// A hop behind a broken path can take its whole deadline to
			// refuse the delete: the error goes out first, so the tracker
			// can route around it at once.
			s.background(free)
		} else {
			free()
		}
	}()

	var onToken func(engine.Token) error
	if j.stream && j.tools == nil { // with tools, the message is sent whole once parsed
		first := true
		streamed := 0         // tokens whose logprobs went out
		offset := len(c.echo) // completions logprobs: where the next token's text starts
		onToken = func(t engine.Token) error {
			ch := s.chunk(j)
			text := t.Text
			if first {
				text = c.echo + text
			}
			wc := openai.Choice{Index: c.index}
			if j.chat {
				d := &openai.ChatMessage{Content: &text}
				if first {
					d.Role = "assistant"
				}
				wc.Delta = d
			} else {
				wc.Text = &text
			}
			first = false
			if t.ID >= 0 { // -1: text held back for a possible stop string, released at the end
				ch.Meshgpu = &openai.ChunkMeshgpu{Token: t.ID, Logprob: t.Logprob}
				if j.logprobs && streamed < len(p.logprobs) {
					wc.Logprobs = s.logprobsOf(j, []int32{t.ID}, p.logprobs[streamed:streamed+1], offset)
					ch.Meshgpu.Top = p.logprobs[streamed].Top
					offset += len(s.Model.Tokenizer.Decode([]int32{t.ID}, false))
					streamed++
				}
			}
			ch.Choices = []openai.Choice{wc}
			return sse.Event(ch)
		}
	}
	start := time.Now()
	step := p.multiStepper()
	params := c.params
	if j.resumed > 0 {
		// Continue the earlier attempt's stream (its held-back text comes
		// with the next token) and its draws: its ids were steps 0..resumed-1.
		params.Resume = c.prompt[len(c.prompt)-j.resumed:]
		inner := step
		step = func(ctx context.Context, pos int, tokens []int32, i, limit int) ([]sample.Draw, error) {
			return inner(ctx, pos, tokens, i+j.resumed, limit)
		}
	}
	res, err := engine.DecodeMulti(ctx, s.Model.Tokenizer, s.Model.EOS(), c.prompt, params, step, onToken)
	if err == nil {
		if ae := p.settleChains(); ae != nil {
			err = ae
		}
	}
	if err != nil {
		failed = true
		ae := asAPIError(err)
		if ctx.Err() != nil {
			s.Logger.Info("client went away; freeing the session on every hop", "id", j.id, "hops", len(route))
			return nil, nil, &apiError{Status: 499, Type: "canceled", Message: "client disconnected"}
		}
		if ae.Hop != "" {
			s.forgetPeerRoute()
		} else if ae.Status >= 500 {
			ae.Hop = s.selfName() // the head itself failed
		}
		s.Logger.Warn("generation failed", "id", j.id, "error", ae.Message, "hop", ae.Hop, "status", ae.Status)
		return nil, nil, ae
	}
	if j.tools != nil {
		c.content, c.toolCalls = parseToolCalls(res.Text, j.tools)
		if len(c.toolCalls) > 0 {
			res.FinishReason = openai.FinishToolCalls
		} else {
			c.content = &res.Text
		}
		if j.stream {
			ch := s.chunk(j)
			ch.Choices = []openai.Choice{{Index: c.index, Delta: &openai.ChatMessage{Role: "assistant", Content: c.content, ToolCalls: c.toolCalls}}}
			if err := sse.Event(ch); err != nil {
				return nil, nil, &apiError{Status: 499, Type: "canceled", Message: "client disconnected"}
			}
		}
	}
	s.Logger.Debug("generated", "id", j.id, "choice", c.index, "prompt_tokens", res.PromptTokens, "completion_tokens", res.CompletionTokens,
		"finish", res.FinishReason, "took", time.Since(start), "hops", len(route))
	if j.stream {
		reason := res.FinishReason
		ch := s.chunk(j)
		wc := openai.Choice{Index: c.index, FinishReason: &reason}
		if j.chat {
			wc.Delta = &openai.ChatMessage{}
		} else {
			empty := ""
			if first := res.CompletionTokens == 0 && c.echo != ""; first {
				empty = c.echo
			}
			wc.Text = &empty
		}
		ch.Choices = []openai.Choice{wc}
		if res.EOS && j.logprobs && j.tools == nil {
			// The end-of-text step's draw and alternatives (the step after
			// the streamed ones), for the tracker's audit of the ending.
			if k := len(res.IDs); k < len(p.logprobs) {
				ch.MeshgpuEnd = &openai.ChunkMeshgpu{Token: res.EOSID, Logprob: p.logprobs[k].Logprob, Top: p.logprobs[k].Top}
			}
		}
		if !j.usage && len(j.choices) == 1 {
			// one choice: usage rides on the final chunk, as before
			pt := res.PromptTokens - j.resumed
			ch.Usage = &openai.Usage{PromptTokens: pt, CompletionTokens: res.CompletionTokens, TotalTokens: pt + res.CompletionTokens}
		}
		if err := sse.Event(ch); err != nil {
			return nil, nil, &apiError{Status: 499, Type: "canceled", Message: "client disconnected"}
		}
	}
	lps := p.logprobs
	if len(lps) > len(res.IDs) {
		lps = lps[:len(res.IDs)] // the last draw was an end-of-sequence token
	}
	return res, lps, nil
}

func (s *Server) chunk(j *job) *openai.Completion {
	return &openai.Completion{ID: j.id, Object: openai.Object(j.chat, true), Created: j.created, Model: s.ModelName}
}
