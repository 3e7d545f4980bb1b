package node

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"meshgpu/engine"
	"meshgpu/openai"
	"meshgpu/sample"
	"meshgpu/wire"
)

// parseJob turns one OpenAI request into a job, in the order a request is
// understood: read the body, parse and validate it (openai.ParseRequest, the
// same as the tracker), then what needs the model: the response format,
// the prompts (template and tools, or the completions prompts), the
// tracker's continuation, and one choice per prompt and n.
func (s *Server) parseJob(w http.ResponseWriter, r *http.Request, chatAPI bool) (*job, *apiError) {
	body, ae := s.readRequestBody(w, r)
	if ae != nil {
		return nil, ae
	}
	req, we := openai.ParseRequest(body, chatAPI)
	if we != nil {
		return nil, fromWire(we)
	}
	if req.Model != "" && req.Model != s.ModelName {
		return nil, fromWire(openai.ModelNotFound(req.Model))
	}
	j := &job{chat: chatAPI, stream: req.Stream, usage: req.IncludeUsage, logprobs: req.LogprobsOn, echo: req.Echo,
		id: openai.NewID(openai.IDPrefix(chatAPI)), created: time.Now().Unix()}
	format, ae := responseFormat(req)
	if ae != nil {
		return nil, ae
	}
	var prompts [][]int32
	var echoes []string
	if chatAPI {
		prompts, echoes, format, ae = s.renderChat(req, j, format)
	} else {
		prompts, echoes, ae = s.completionPrompts(req)
	}
	if ae != nil {
		return nil, ae
	}
	for i := range prompts {
		if len(prompts[i]) == 0 {
			return nil, &apiError{Status: 400, Type: "invalid_request_error", Param: "prompt", Message: "the prompt is empty"}
		}
	}
	if ae := s.continueIDs(req, j, prompts); ae != nil {
		return nil, ae
	}
	if j.speculate, ae = s.speculateMode(req); ae != nil {
		return nil, ae
	}
	p, err := samplingParams(req, format)
	if err != nil {
		return nil, badRequest("sampling parameters: %v", err)
	}
	for pi, prompt := range prompts {
		if ae := s.addChoices(req, j, p, prompt, echoes[pi], pi); ae != nil {
			return nil, ae
		}
	}
	return j, nil
}

// readRequestBody reads the body within MaxRequestBytes and HopTimeout. A
// client trickling its body must not hold the handler forever; the
// deadline is cleared once the body is in: left set, it would end the
// connection (and the request's context) in the middle of a long answer.
func (s *Server) readRequestBody(w http.ResponseWriter, r *http.Request) ([]byte, *apiError) {
	rc := http.NewResponseController(w)
	rc.SetReadDeadline(time.Now().Add(s.HopTimeout))
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.MaxRequestBytes))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, &apiError{Status: http.StatusRequestEntityTooLarge, Type: "invalid_request_error",
				Message: fmt.Sprintf("request body is over %d bytes", s.MaxRequestBytes)}
		}
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return nil, &apiError{Status: http.StatusRequestTimeout, Type: "invalid_request_error",
				Message: fmt.Sprintf("the request body did not arrive within %v", s.HopTimeout)}
		}
		return nil, badRequest("reading the request body: %v", err)
	}
	rc.SetReadDeadline(time.Time{})
	return body, nil
}

// responseFormat is the request's response_format as the constrained
// decoder's spec (nil: none), checked to fit a hop binding and to compile.
func responseFormat(req *openai.Request) ([]byte, *apiError) {
	if req.FormatKind == "" {
		return nil, nil
	}
	f := formatSpec{Type: req.FormatKind}
	if req.FormatKind == "json_schema" {
		var b bytes.Buffer
		json.Compact(&b, req.ResponseFormat.JSONSchema.Schema)
		f.Schema = b.Bytes()
	}
	format, _ := json.Marshal(f)
	if len(format) > wire.MaxFormatBytes {
		return nil, &apiError{Status: 400, Type: "invalid_request_error", Param: "response_format.json_schema.schema",
			Message: fmt.Sprintf("the schema is %d bytes; at most %d", len(format), wire.MaxFormatBytes)}
	}
	if _, err := compileFormat(format); err != nil {
		return nil, &apiError{Status: 400, Type: "invalid_request_error", Param: "response_format.json_schema.schema", Message: err.Error()}
	}
	if req.IgnoreEOS {
		return nil, &apiError{Status: 400, Type: "invalid_request_error", Param: "ignore_eos",
			Message: "ignore_eos cannot be used with response_format: generation ends when the document is complete"}
	}
	return format, nil
}

// renderChat renders the messages (and any tools) with the model's chat
// template into the one prompt of a chat request. Tools set j.tools and
// may replace the format: tool_choice "required" or a named function
// forces a call; "auto" constrains only a call the model starts.
func (s *Server) renderChat(req *openai.Request, j *job, format []byte) ([][]int32, []string, []byte, *apiError) {
	tmpl := s.Model.Template
	offerTools := len(req.Tools) > 0 && !req.ToolsNone
	if offerTools && (tmpl == nil || !tmpl.RendersTools()) {
		return nil, nil, nil, &apiError{Status: 400, Type: "invalid_request_error", Param: "tools",
			Message: "this model's chat template does not render tools; send the request without tools (or with tool_choice \"none\")"}
	}
	if tmpl == nil {
		return nil, nil, nil, &apiError{Status: 400, Type: "invalid_request_error", Param: "messages", Message: "this model has no chat template; use /v1/completions"}
	}
	var tools []any
	if offerTools {
		tools = templateTools(req)
		ts := &toolSyntax{names: map[string]bool{}}
		ts.prefix, ts.suffix, ts.argsKey = tmpl.ToolSyntax()
		for _, t := range req.Tools {
			ts.names[t.Function.Name] = true
		}
		j.tools = ts
		var ae *apiError
		if format, ae = toolFormat(req, ts, format); ae != nil {
			return nil, nil, nil, ae
		}
	}
	text, err := tmpl.RenderTools(templateMessages(req), tools, true)
	if err != nil {
		return nil, nil, nil, &apiError{Status: 400, Type: "invalid_request_error", Param: "messages", Message: "chat template: " + err.Error()}
	}
	// The rendered template already holds any BOS and special tokens.
	return [][]int32{s.Model.Tokenizer.Encode(text, false)}, []string{""}, format, nil
}

// toolFormat is the format a request with tools decodes under: a forced
// call's schema, or (auto) a trigger that constrains a call once started;
// the request's own format otherwise.
func toolFormat(req *openai.Request, ts *toolSyntax, format []byte) ([]byte, *apiError) {
	if !req.ToolsRequired && format == nil && ts.prefix != "" {
		f := forcedToolFormat(req, ts)
		f.Trigger = true
		if b, _ := json.Marshal(f); len(b) <= wire.MaxFormatBytes {
			if _, err := compileFormat(b); err != nil {
				return nil, &apiError{Status: 400, Type: "invalid_request_error", Param: "tools", Message: err.Error()}
			}
			format = b
		}
	}
	if !req.ToolsRequired {
		return format, nil
	}
	if format != nil {
		return nil, &apiError{Status: 400, Type: "invalid_request_error", Param: "response_format",
			Message: "a forced tool call (tool_choice) and response_format cannot be combined"}
	}
	format, _ = json.Marshal(forcedToolFormat(req, ts))
	if len(format) > wire.MaxFormatBytes {
		return nil, &apiError{Status: 400, Type: "invalid_request_error", Param: "tools",
			Message: fmt.Sprintf("the tools' schemas are %d bytes; a forced call takes at most %d", len(format), wire.MaxFormatBytes)}
	}
	if _, err := compileFormat(format); err != nil {
		return nil, &apiError{Status: 400, Type: "invalid_request_error", Param: "tools", Message: err.Error()}
	}
	return format, nil
}

// completionPrompts tokenizes /v1/completions prompts (text or ids), with
// the text each would echo.
func (s *Server) completionPrompts(req *openai.Request) ([][]int32, []string, *apiError) {
	tok := s.Model.Tokenizer
	var prompts [][]int32
	var echoes []string
	for i, p := range req.Prompts {
		if !p.IsIDs {
			prompts = append(prompts, tok.Encode(p.Text, true))
			echoes = append(echoes, p.Text)
			continue
		}
		ids := make([]int32, len(p.IDs))
		for k, id := range p.IDs {
			if id >= int64(s.cfg.Vocab) {
				return nil, nil, &apiError{Status: 400, Type: "invalid_request_error", Param: "prompt",
					Message: fmt.Sprintf("token id %d at index %d of prompt %d is outside the vocabulary of %d", id, k, i, s.cfg.Vocab)}
			}
			ids[k] = int32(id)
		}
		prompts = append(prompts, ids)
		echoes = append(echoes, tok.Decode(ids, false))
	}
	return prompts, echoes, nil
}

// continueIDs appends the tracker's meshgpu.continue_ids (a failover's
// tokens so far) to the single prompt.
func (s *Server) continueIDs(req *openai.Request, j *job, prompts [][]int32) *apiError {
	if req.Meshgpu == nil || len(req.Meshgpu.ContinueIDs) == 0 {
		return nil
	}
	for i, id := range req.Meshgpu.ContinueIDs {
		if id < 0 || id >= int64(s.cfg.Vocab) {
			return &apiError{Status: 400, Type: "invalid_request_error", Param: "meshgpu.continue_ids",
				Message: fmt.Sprintf("token id %d at index %d is outside the vocabulary of %d", id, i, s.cfg.Vocab)}
		}
		prompts[0] = append(prompts[0], int32(id))
	}
	j.resumed = len(req.Meshgpu.ContinueIDs)
	j.echo = false // the first attempt sent it
	return nil
}

// speculateMode is the head's speculative decoding unless the request
// chose (meshgpu.speculate).
func (s *Server) speculateMode(req *openai.Request) (wire.SpeculateMode, *apiError) {
	if req.Meshgpu == nil || req.Meshgpu.Speculate == "" {
		return s.Speculate, nil
	}
	m, err := wire.ParseSpeculateMode(req.Meshgpu.Speculate)
	if err != nil {
		return s.Speculate, &apiError{Status: 400, Type: "invalid_request_error", Param: "meshgpu.speculate", Message: err.Error()}
	}
	if m == wire.SpeculateDraft && s.DraftModel == nil {
		return s.Speculate, &apiError{Status: 400, Type: "invalid_request_error", Param: "meshgpu.speculate",
			Message: "this head has no draft model (start it with --draft-model); use off or ngram"}
	}
	return m, nil
}

// samplingParams are the request's sampling parameters with OpenAI's
// defaults, validated.
func samplingParams(req *openai.Request, format []byte) (sample.Params, error) {
	p := sample.Params{Temperature: 1} // OpenAI's default temperature
	if req.Temperature != nil {
		p.Temperature = *req.Temperature
	}
	if req.TopP != nil {
		p.TopP = *req.TopP
	}
	if req.TopK != nil && *req.TopK > 0 {
		p.TopK = *req.TopK
	}
	if req.MinP != nil {
		p.MinP = *req.MinP
	}
	if req.RepetitionPenalty != nil {
		p.RepetitionPenalty = *req.RepetitionPenalty
	}
	if req.PresencePenalty != nil {
		p.PresencePenalty = *req.PresencePenalty
	}
	if req.FrequencyPenalty != nil {
		p.FrequencyPenalty = *req.FrequencyPenalty
	}
	p.Logprobs, p.TopLogprobs = req.LogprobsOn, req.TopLogprobsN
	p.ResponseFormat = format
	if req.Seed != nil {
		p.Seed = uint64(*req.Seed)
	} else {
		var b [8]byte
		rand.Read(b[:])
		p.Seed = binary.LittleEndian.Uint64(b[:]) // no seed: a fresh draw, like OpenAI
	}
	return p, p.Validate()
}

// addChoices adds prompt pi's n choices to j, each with its own seed and
// the max_tokens that fit the context.
func (s *Server) addChoices(req *openai.Request, j *job, p sample.Params, prompt []int32, echo string, pi int) *apiError {
	maxTokens, ae := s.maxTokens(req, j, prompt)
	if ae != nil {
		return ae
	}
	for k := 0; k < req.NChoices; k++ {
		cp := p
		cp.Seed = openai.ChoiceSeed(p.Seed, k)
		if p.ResponseFormat != nil {
			var f formatSpec
			json.Unmarshal(p.ResponseFormat, &f)
			f.MaxSteps = j.resumed + maxTokens
			cp.ResponseFormat, _ = json.Marshal(f)
		}
		c := &choice{index: pi*req.NChoices + k, prompt: prompt,
			params: engine.GenerateParams{MaxTokens: maxTokens, Sampling: cp, Stop: req.StopList, IgnoreEOS: req.IgnoreEOS}}
		if j.echo {
			c.echo = echo
		}
		if err := c.params.Validate(); err != nil {
			return badRequest("%v", err)
		}
		if we := cp.CheckHopSize(); we != nil {
			return fromWire(we)
		}
		j.choices = append(j.choices, c)
	}
	return nil
}

// maxTokens is how many tokens a choice of this prompt may generate:
// max_tokens when it fits the context (a 400 naming what takes the room
// when it does not), else OpenAI's defaults (16 for completions, the rest
// of the context for chat). It counts the prompt into j.promptTokens.
func (s *Server) maxTokens(req *openai.Request, j *job, prompt []int32) (int, *apiError) {
	n := len(prompt) - j.resumed
	j.promptTokens += n
	room := s.MaxContext - len(prompt)
	if room < 1 && j.resumed > 0 {
		// The continued ids are the tracker's; name them, not the prompt.
		return 0, &apiError{Status: 400, Type: "invalid_request_error", Param: "meshgpu.continue_ids", Code: "context_length_exceeded", Message: fmt.Sprintf(
			"the prompt (%d tokens) and meshgpu.continue_ids (%d ids) make %d tokens; this model's context is %d tokens, and continue_ids must leave room for one more",
			n, j.resumed, len(prompt), s.MaxContext)}
	}
	if room < 1 {
		param := "prompt"
		if j.chat {
			param = "messages"
		}
		return 0, &apiError{Status: 400, Type: "invalid_request_error", Param: param, Code: "context_length_exceeded", Message: fmt.Sprintf(
			"the prompt is %d tokens and this model's context is %d tokens: shorten the prompt", n, s.MaxContext)}
	}
	if req.MaxTokensSet <= 0 {
		if j.chat {
			return room, nil // chat: up to the context, as OpenAI
		}
		return min(16, room), nil // OpenAI's default for /v1/completions
	}
	// A continuation's max_tokens already counts only new tokens.
	if req.MaxTokensSet > room {
		took := fmt.Sprintf("the prompt takes %d", n)
		if j.resumed > 0 {
			took = fmt.Sprintf("the prompt and meshgpu.continue_ids take %d (%d + %d)", len(prompt), n, j.resumed)
		}
		return 0, &apiError{Status: 400, Type: "invalid_request_error", Param: "max_tokens", Code: "context_length_exceeded", Message: fmt.Sprintf(
			"max_tokens %d does not fit: this model's context is %d tokens and %s; ask for at most %d", req.MaxTokensSet, s.MaxContext, took, room)}
	}
	return req.MaxTokensSet, nil
}
