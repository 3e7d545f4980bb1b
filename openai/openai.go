package openai

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"meshgpu/wire"
	"net/http"
	"strings"
)

// The OpenAI API's request and response bodies, and the one validation of
// a request that the head node and the tracker both run, so that each bad
// request gets the same status and error from either (docs/protocol.md,
// "OpenAI API", lists every field as supported or refused).

// Limits of one request.
const (
	MaxN        = 16  // choices per prompt
	MaxPrompts  = 16  // prompts of one completions request
	MaxStop     = 16  // stop strings
	MaxStopLen  = 256 // bytes of one stop string
	MaxMessages = 4096
	MaxTools    = 128
)

// A request's top_logprobs and response format are bounded by the hop
// protocol, which carries them in every session binding:
// wire.MaxTopLogprobs and wire.MaxFormatBytes.

// HeaderRequestID carries the request's id: the client's when it sends a
// usable one, else a new one; every answer returns it.
const HeaderRequestID = "X-Request-Id"

// RequestID returns the client's X-Request-Id when it is 1-128 printable
// ASCII characters without spaces, else a new random id.
func RequestID(r *http.Request) string {
	v := r.Header.Get(HeaderRequestID)
	if len(v) > 0 && len(v) <= 128 {
		ok := true
		for i := 0; i < len(v); i++ {
			if v[i] <= ' ' || v[i] > '~' {
				ok = false
				break
			}
		}
		if ok {
			return v
		}
	}
	return NewID("req-")
}

// NewID is prefix plus 24 random hex digits ("chatcmpl-", "cmpl-").
func NewID(prefix string) string {
	b := make([]byte, 12)
	rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// IDPrefix is the id prefix of an endpoint's answers.
func IDPrefix(chat bool) string {
	if chat {
		return "chatcmpl-"
	}
	return "cmpl-"
}

// ChoiceSeed is the seed of choice i of a request with n > 1, so that the
// head generating n choices and the tracker sending n requests of one
// choice each produce the same choices.
func ChoiceSeed(seed uint64, i int) uint64 { return seed + uint64(i) }

// Request is the body of POST /v1/chat/completions (Messages) and
// /v1/completions (Prompt). Unknown fields are ignored, as OpenAI-compatible
// servers do.
type Request struct {
	Model               string          `json:"model"`
	Messages            []Message       `json:"messages,omitempty"`
	Prompt              json.RawMessage `json:"prompt,omitempty"` // string, [string], [ids] or [[ids]]
	MaxTokens           *int            `json:"max_tokens,omitempty"`
	MaxCompletionTokens *int            `json:"max_completion_tokens,omitempty"`
	Temperature         *float64        `json:"temperature,omitempty"`
	TopP                *float64        `json:"top_p,omitempty"`
	N                   *int            `json:"n,omitempty"`
	Stream              bool            `json:"stream,omitempty"`
	StreamOptions       *StreamOptions  `json:"stream_options,omitempty"`
	Stop                json.RawMessage `json:"stop,omitempty"` // string or list of strings
	Seed                *int64          `json:"seed,omitempty"`
	PresencePenalty     *float64        `json:"presence_penalty,omitempty"`
	FrequencyPenalty    *float64        `json:"frequency_penalty,omitempty"`
	Logprobs            json.RawMessage `json:"logprobs,omitempty"` // chat: bool; completions: 0-20
	TopLogprobs         *int            `json:"top_logprobs,omitempty"`
	Echo                bool            `json:"echo,omitempty"`
	BestOf              *int            `json:"best_of,omitempty"`
	Suffix              *string         `json:"suffix,omitempty"`
	LogitBias           map[string]any  `json:"logit_bias,omitempty"`
	User                string          `json:"user,omitempty"`
	ResponseFormat      *ResponseFormat `json:"response_format,omitempty"`
	Tools               []Tool          `json:"tools,omitempty"`
	ToolChoice          json.RawMessage `json:"tool_choice,omitempty"`
	ParallelToolCalls   *bool           `json:"parallel_tool_calls,omitempty"`
	// Extensions (vLLM's spellings).
	TopK              *int     `json:"top_k,omitempty"`
	MinP              *float64 `json:"min_p,omitempty"`
	RepetitionPenalty *float64 `json:"repetition_penalty,omitempty"`
	IgnoreEOS         bool     `json:"ignore_eos,omitempty"`
	// Meshgpu is meshgpu's extension: a client may set only its speculate
	// field; continue_ids is the tracker's (a failover's replay; the
	// tracker refuses it from clients, docs/protocol.md, "Proxy").
	Meshgpu *Continuation `json:"meshgpu,omitempty"`

	// Filled by ParseRequest.
	Chat          bool     `json:"-"`
	Prompts       []Prompt `json:"-"` // completions: one or more prompts
	StopList      []string `json:"-"`
	NChoices      int      `json:"-"` // n, default 1
	MaxTokensSet  int      `json:"-"` // max_tokens or max_completion_tokens; 0: not given
	LogprobsOn    bool     `json:"-"` // return logprobs
	TopLogprobsN  int      `json:"-"` // alternatives per token
	IncludeUsage  bool     `json:"-"`
	Texts         []string `json:"-"` // chat: each message's content as text
	ToolsRequired bool     `json:"-"` // tool_choice "required" or a named function
	ToolsNone     bool     `json:"-"` // tool_choice "none"
	ToolName      string   `json:"-"` // tool_choice names this function
	FormatKind    string   `json:"-"` // "", "json_object" or "json_schema"
}

// StreamOptions is stream_options.
type StreamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// Continuation carries ids an earlier, failed attempt already generated:
// they extend the prompt and the first new token is sampled as step
// len(ContinueIDs).
type Continuation struct {
	ContinueIDs []int64 `json:"continue_ids"`
	// Speculation is the one field a client may set (wire/speculate.go).
	wire.Speculation
}

// Prompt is one completions prompt: text or token ids.
type Prompt struct {
	Text  string
	IDs   []int64
	IsIDs bool
}

// Message is one chat message of a request.
type Message struct {
	Role       string          `json:"role"`
	Content    Content         `json:"content"`
	Name       string          `json:"name,omitempty"`
	ToolCalls  []ToolCall      `json:"tool_calls,omitempty"`
	ToolCallID string          `json:"tool_call_id,omitempty"`
	Refusal    json.RawMessage `json:"refusal,omitempty"`
}

// Content is a message's content: a string, null, or a list of parts.
type Content struct {
	Text  string
	Parts []ContentPart // nil for the string form
	Null  bool
}

// ContentPart is one part of an array content.
type ContentPart struct {
	Type string  `json:"type"`
	Text *string `json:"text,omitempty"`
}

func (c *Content) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	switch {
	case string(b) == "null":
		*c = Content{Null: true}
		return nil
	case len(b) > 0 && b[0] == '"':
		*c = Content{}
		return json.Unmarshal(b, &c.Text)
	case len(b) > 0 && b[0] == '[':
		var parts []ContentPart
		if err := json.Unmarshal(b, &parts); err != nil {
			return errors.New("content must be a string or a list of {\"type\",\"text\"} parts")
		}
		*c = Content{Parts: append([]ContentPart{}, parts...)}
		return nil
	}
	return errors.New("content must be a string or a list of parts")
}

func (c Content) MarshalJSON() ([]byte, error) {
	switch {
	case c.Null:
		return []byte("null"), nil
	case c.Parts != nil:
		return json.Marshal(c.Parts)
	}
	return json.Marshal(c.Text)
}

// ResponseFormat is response_format.
type ResponseFormat struct {
	Type       string      `json:"type"`
	JSONSchema *JSONSchema `json:"json_schema,omitempty"`
}

// JSONSchema is response_format.json_schema.
type JSONSchema struct {
	Name   string          `json:"name"`
	Schema json.RawMessage `json:"schema,omitempty"`
	Strict *bool           `json:"strict,omitempty"`
}

// Tool is one entry of tools.
type Tool struct {
	Type     string       `json:"type"`
	Function ToolFunction `json:"function"`
}

// ToolFunction describes a callable function.
type ToolFunction struct {
	Name        string          `json:"name"`
	Description string          `json:"description,omitempty"`
	Parameters  json.RawMessage `json:"parameters,omitempty"`
	Strict      *bool           `json:"strict,omitempty"`
}

// ToolCall is a call in an assistant message (Index only in stream deltas).
type ToolCall struct {
	Index    *int             `json:"index,omitempty"`
	ID       string           `json:"id,omitempty"`
	Type     string           `json:"type,omitempty"`
	Function ToolCallFunction `json:"function"`
}

// ToolCallFunction is the function a tool call names and its JSON arguments.
type ToolCallFunction struct {
	Name      string `json:"name,omitempty"`
	Arguments string `json:"arguments"`
}

// ParseRequest decodes and validates a request of the chat (chat true) or
// completions endpoint. It checks what needs no model; the head then checks
// the model, the context and the template.
func ParseRequest(body []byte, chat bool) (*Request, *wire.Error) {
	var req Request
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&req); err != nil {
		return nil, decodeError(err)
	}
	if dec.More() {
		return nil, wire.Invalid("", "the request body holds data after its JSON object")
	}
	req.Chat = chat
	if ae := req.validate(); ae != nil {
		return nil, ae
	}
	return &req, nil
}

func decodeError(err error) *wire.Error {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		field := te.Field
		return wire.Invalid(field, "%s has the wrong type: got a JSON %s, want %s", orBody(field), te.Value, jsonType(te.Type.String()))
	}
	var se *json.SyntaxError
	if errors.As(err, &se) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return wire.Invalid("", "the request body is not valid JSON: %v", err)
	}
	msg := err.Error()
	if strings.Contains(msg, "cannot unmarshal") || strings.HasPrefix(msg, "json:") {
		return wire.Invalid("", "the request body is not a JSON object of this endpoint's fields")
	}
	if strings.Contains(msg, "content must be") {
		return wire.Invalid("messages", "message content must be a string, null or a list of parts")
	}
	return wire.Invalid("", "the request body is not valid JSON: %v", err)
}

func orBody(field string) string {
	if field == "" {
		return "the request body"
	}
	return field
}

// jsonType names a Go type as the JSON type a client should send.
func jsonType(goType string) string {
	switch {
	case strings.HasPrefix(goType, "*"):
		return jsonType(goType[1:])
	case goType == "string":
		return "a string"
	case goType == "bool":
		return "true or false"
	case strings.HasPrefix(goType, "int") || strings.HasPrefix(goType, "uint"):
		return "an integer"
	case strings.HasPrefix(goType, "float"):
		return "a number"
	case strings.HasPrefix(goType, "[]"):
		return "a list"
	case strings.HasPrefix(goType, "map") || strings.Contains(goType, "openai.") || strings.Contains(goType, "wire."):
		return "an object"
	}
	return goType
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

func (r *Request) validate() *wire.Error {
	if r.Chat {
		if ae := r.validateMessages(); ae != nil {
			return ae
		}
	} else {
		if len(r.Messages) > 0 {
			return wire.Invalid("messages", "messages belong to /v1/chat/completions; /v1/completions takes prompt")
		}
		if ae := r.parsePrompts(); ae != nil {
			return ae
		}
		if r.Suffix != nil && *r.Suffix != "" {
			return wire.Invalid("suffix", "suffix (insertion) is not supported")
		}
	}
	mt := r.MaxTokens
	name := "max_tokens"
	if r.Chat && r.MaxCompletionTokens != nil {
		mt, name = r.MaxCompletionTokens, "max_completion_tokens"
	}
	if mt != nil {
		if *mt < 1 {
			return wire.Invalid(name, "%s is %d; it must be at least 1", name, *mt)
		}
		r.MaxTokensSet = *mt
	}
	if v := r.Temperature; v != nil && (!finite(*v) || *v < 0 || *v > 100) {
		return wire.Invalid("temperature", "temperature %v must be in 0..100 (0 = greedy; OpenAI uses 0..2)", *v)
	}
	if v := r.TopP; v != nil && (!finite(*v) || *v < 0 || *v > 1) {
		return wire.Invalid("top_p", "top_p %v must be in 0..1", *v)
	}
	if v := r.TopK; v != nil && *v < -1 {
		return wire.Invalid("top_k", "top_k %d must be -1 or 0 (off) or positive", *v)
	}
	if v := r.MinP; v != nil && (!finite(*v) || *v < 0 || *v > 1) {
		return wire.Invalid("min_p", "min_p %v must be in 0..1", *v)
	}
	if v := r.RepetitionPenalty; v != nil && (!finite(*v) || *v < 0 || *v > 100) {
		return wire.Invalid("repetition_penalty", "repetition_penalty %v must be in 0..100 (0 or 1 = off)", *v)
	}
	for _, p := range []struct {
		name string
		v    *float64
	}{{"presence_penalty", r.PresencePenalty}, {"frequency_penalty", r.FrequencyPenalty}} {
		if p.v != nil && (!finite(*p.v) || *p.v < -2 || *p.v > 2) {
			return wire.Invalid(p.name, "%s %v must be in -2..2", p.name, *p.v)
		}
	}
	r.NChoices = 1
	if r.N != nil {
		if *r.N < 1 || *r.N > MaxN {
			return wire.Invalid("n", "n is %d; it must be in 1..%d", *r.N, MaxN)
		}
		r.NChoices = *r.N
	}
	if r.BestOf != nil && *r.BestOf != 1 && *r.BestOf != r.NChoices {
		return wire.Invalid("best_of", "best_of (server-side choice of the best of several) is not supported")
	}
	if !r.Chat && len(r.Prompts)*r.NChoices > MaxN*MaxPrompts/4 {
		return wire.Invalid("n", "%d prompts times n=%d is more than %d choices", len(r.Prompts), r.NChoices, MaxN*MaxPrompts/4)
	}
	if r.StreamOptions != nil {
		if !r.Stream {
			return wire.Invalid("stream_options", "stream_options is only allowed with stream: true")
		}
		r.IncludeUsage = r.StreamOptions.IncludeUsage
	}
	if ae := r.parseStop(); ae != nil {
		return ae
	}
	if ae := r.parseLogprobs(); ae != nil {
		return ae
	}
	if len(r.LogitBias) > 0 {
		return wire.Invalid("logit_bias", "logit_bias is not supported")
	}
	if ae := r.validateFormat(); ae != nil {
		return ae
	}
	if ae := r.validateTools(); ae != nil {
		return ae
	}
	if r.Meshgpu != nil && len(r.Meshgpu.ContinueIDs) > 0 && (r.NChoices > 1 || len(r.Prompts) > 1) {
		return wire.Invalid("meshgpu.continue_ids", "continue_ids needs n=1 and one prompt")
	}
	return nil
}

func (r *Request) validateMessages() *wire.Error {
	if len(r.Messages) == 0 {
		return wire.Invalid("messages", "messages must be a non-empty list")
	}
	if len(r.Messages) > MaxMessages {
		return wire.Invalid("messages", "%d messages, at most %d", len(r.Messages), MaxMessages)
	}
	if r.Echo {
		return wire.Invalid("echo", "echo belongs to /v1/completions")
	}
	r.Texts = make([]string, len(r.Messages))
	for i, m := range r.Messages {
		switch m.Role {
		case "system", "developer", "user", "assistant", "tool":
		case "":
			return wire.Invalid(fmt.Sprintf("messages[%d].role", i), "messages[%d] has no role", i)
		default:
			return wire.Invalid(fmt.Sprintf("messages[%d].role", i), "messages[%d].role %q is not one of system, developer, user, assistant, tool", i, trunc(m.Role, 40))
		}
		if m.Content.Null && !(m.Role == "assistant" && len(m.ToolCalls) > 0) {
			return wire.Invalid(fmt.Sprintf("messages[%d].content", i), "messages[%d].content is null; only an assistant message with tool_calls may omit it", i)
		}
		if m.Content.Parts == nil {
			r.Texts[i] = m.Content.Text
			continue
		}
		texts := make([]string, 0, len(m.Content.Parts))
		for j, p := range m.Content.Parts {
			param := fmt.Sprintf("messages[%d].content[%d].type", i, j)
			switch p.Type {
			case "text":
				if p.Text == nil {
					return wire.Invalid(fmt.Sprintf("messages[%d].content[%d].text", i, j), "a text part needs text")
				}
				texts = append(texts, *p.Text)
			case "image_url", "input_audio", "file", "image", "audio", "input_image", "video_url":
				return wire.Invalid(param, "content part type %q is not supported: this model reads text only", p.Type)
			default:
				return wire.Invalid(param, "unknown content part type %q (want \"text\")", trunc(p.Type, 40))
			}
		}
		// Text parts are joined with newlines, as vLLM does.
		r.Texts[i] = strings.Join(texts, "\n")
	}
	return nil
}

func (r *Request) parsePrompts() *wire.Error {
	raw := bytes.TrimSpace(r.Prompt)
	if len(raw) == 0 || string(raw) == "null" {
		return wire.Invalid("prompt", "prompt is required")
	}
	var text string
	if json.Unmarshal(raw, &text) == nil {
		r.Prompts = []Prompt{{Text: text}}
		return nil
	}
	var texts []string
	var ids []int64
	var lists [][]int64
	switch {
	case json.Unmarshal(raw, &texts) == nil:
		for _, t := range texts {
			r.Prompts = append(r.Prompts, Prompt{Text: t})
		}
	case json.Unmarshal(raw, &ids) == nil:
		r.Prompts = []Prompt{{IDs: ids, IsIDs: true}}
	case json.Unmarshal(raw, &lists) == nil:
		for _, l := range lists {
			r.Prompts = append(r.Prompts, Prompt{IDs: l, IsIDs: true})
		}
	default:
		return wire.Invalid("prompt", "prompt must be a string, a list of strings, a list of token ids or a list of such lists")
	}
	if len(r.Prompts) == 0 {
		return wire.Invalid("prompt", "prompt is an empty list")
	}
	if len(r.Prompts) > MaxPrompts {
		return wire.Invalid("prompt", "%d prompts, at most %d per request", len(r.Prompts), MaxPrompts)
	}
	for i, p := range r.Prompts {
		if p.IsIDs && len(p.IDs) == 0 || !p.IsIDs && p.Text == "" {
			return wire.Invalid("prompt", "prompt %d is empty", i)
		}
		for k, id := range p.IDs {
			if id < 0 {
				return wire.Invalid("prompt", "token id %d at index %d of prompt %d is negative", id, k, i)
			}
		}
	}
	return nil
}

func (r *Request) parseStop() *wire.Error {
	raw := bytes.TrimSpace(r.Stop)
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	var one string
	var list []string
	if json.Unmarshal(raw, &one) == nil {
		list = []string{one}
	} else if json.Unmarshal(raw, &list) != nil {
		return wire.Invalid("stop", "stop must be a string or a list of strings")
	}
	if len(list) > MaxStop {
		return wire.Invalid("stop", "%d stop sequences, at most %d", len(list), MaxStop)
	}
	for _, s := range list {
		if len(s) > MaxStopLen {
			return wire.Invalid("stop", "a stop sequence is %d bytes, at most %d", len(s), MaxStopLen)
		}
		if s != "" {
			r.StopList = append(r.StopList, s)
		}
	}
	return nil
}

func (r *Request) parseLogprobs() *wire.Error {
	raw := bytes.TrimSpace(r.Logprobs)
	if r.Chat {
		if len(raw) > 0 && string(raw) != "null" {
			if json.Unmarshal(raw, &r.LogprobsOn) != nil {
				return wire.Invalid("logprobs", "logprobs must be true or false on /v1/chat/completions")
			}
		}
		if r.TopLogprobs != nil {
			if *r.TopLogprobs < 0 || *r.TopLogprobs > wire.MaxTopLogprobs {
				return wire.Invalid("top_logprobs", "top_logprobs %d must be in 0..%d", *r.TopLogprobs, wire.MaxTopLogprobs)
			}
			if *r.TopLogprobs > 0 && !r.LogprobsOn {
				return wire.Invalid("top_logprobs", "top_logprobs needs logprobs: true")
			}
			r.TopLogprobsN = *r.TopLogprobs
		}
		return nil
	}
	if len(raw) > 0 && string(raw) != "null" {
		var n int
		if json.Unmarshal(raw, &n) != nil || n < 0 || n > wire.MaxTopLogprobs {
			return wire.Invalid("logprobs", "logprobs must be an integer in 0..%d on /v1/completions", wire.MaxTopLogprobs)
		}
		r.LogprobsOn, r.TopLogprobsN = true, n
	}
	if r.Echo && r.LogprobsOn {
		return wire.Invalid("logprobs", "logprobs with echo (the prompt's own logprobs) is not supported")
	}
	return nil
}

func (r *Request) validateFormat() *wire.Error {
	f := r.ResponseFormat
	if f == nil {
		return nil
	}
	switch f.Type {
	case "", "text":
		return nil
	case "json_object":
		r.FormatKind = "json_object"
	case "json_schema":
		if f.JSONSchema == nil || len(bytes.TrimSpace(f.JSONSchema.Schema)) == 0 {
			return wire.Invalid("response_format.json_schema.schema", "json_schema needs a schema")
		}
		var obj map[string]any
		if json.Unmarshal(f.JSONSchema.Schema, &obj) != nil {
			return wire.Invalid("response_format.json_schema.schema", "the schema must be a JSON object")
		}
		var b bytes.Buffer
		json.Compact(&b, f.JSONSchema.Schema)
		if b.Len() > wire.MaxFormatBytes {
			return wire.Invalid("response_format.json_schema.schema", "the schema is %d bytes (compacted); at most %d", b.Len(), wire.MaxFormatBytes)
		}
		r.FormatKind = "json_schema"
	default:
		return wire.Invalid("response_format.type", "response_format.type %q is not one of text, json_object, json_schema", trunc(f.Type, 40))
	}
	return nil
}

func (r *Request) validateTools() *wire.Error {
	if !r.Chat {
		if len(r.Tools) > 0 {
			return wire.Invalid("tools", "tools belong to /v1/chat/completions")
		}
		return nil
	}
	if len(r.Tools) > MaxTools {
		return wire.Invalid("tools", "%d tools, at most %d", len(r.Tools), MaxTools)
	}
	names := map[string]bool{}
	for i, t := range r.Tools {
		if t.Type != "function" {
			return wire.Invalid(fmt.Sprintf("tools[%d].type", i), "tools[%d].type %q: only \"function\" tools exist", i, trunc(t.Type, 40))
		}
		if t.Function.Name == "" {
			return wire.Invalid(fmt.Sprintf("tools[%d].function.name", i), "tools[%d] has no function name", i)
		}
		if p := bytes.TrimSpace(t.Function.Parameters); len(p) > 0 && string(p) != "null" {
			var obj map[string]any
			if json.Unmarshal(p, &obj) != nil {
				return wire.Invalid(fmt.Sprintf("tools[%d].function.parameters", i), "parameters must be a JSON schema object")
			}
		}
		names[t.Function.Name] = true
	}
	raw := bytes.TrimSpace(r.ToolChoice)
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		switch s {
		case "none":
			r.ToolsNone = true
		case "auto":
		case "required":
			if len(r.Tools) == 0 {
				return wire.Invalid("tool_choice", "tool_choice \"required\" needs tools")
			}
			r.ToolsRequired = true
		default:
			return wire.Invalid("tool_choice", "tool_choice %q is not none, auto or required", trunc(s, 40))
		}
		return nil
	}
	var named struct {
		Type     string `json:"type"`
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	}
	if json.Unmarshal(raw, &named) != nil || named.Type != "function" || !names[named.Function.Name] {
		return wire.Invalid("tool_choice", "tool_choice must be none, auto, required or {\"type\":\"function\",\"function\":{\"name\":...}} naming one of tools")
	}
	r.ToolsRequired, r.ToolName = true, named.Function.Name
	return nil
}

func trunc(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// Usage is OpenAI's token accounting.
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// Completion is a response body or one SSE chunk of either endpoint as a
// server writes it; a reader decodes a chunk as Chunk (chunk.go).
type Completion = CompletionOf[Choice]

// CompletionOf is an answer or chunk with choices of type C: Choice when
// written, ChunkChoice when read. Meshgpu carries the id of the token a
// chunk streams, so a proxy can resume a broken stream (docs/protocol.md,
// "Proxy").
type CompletionOf[C any] struct {
	ID                string        `json:"id"`
	Object            string        `json:"object"`
	Created           int64         `json:"created"`
	Model             string        `json:"model"`
	SystemFingerprint string        `json:"system_fingerprint,omitempty"`
	Choices           []C           `json:"choices"`
	Usage             *Usage        `json:"usage,omitempty"`
	Meshgpu           *ChunkMeshgpu `json:"meshgpu,omitempty"`
	// MeshgpuEnd is the step that ended the text with an end-of-text
	// token (with logprobs on, on the final chunk): the token drawn, its
	// logprob and the step's top alternatives, so an audit can judge a
	// route that ended (or went on) where its referee did not.
	MeshgpuEnd *ChunkMeshgpu `json:"meshgpu_end,omitempty"`
	// Error is set only in the event a failing stream ends with (then
	// nothing else is).
	Error *wire.Error `json:"error,omitempty"`
}

// Objects of Completion.
const (
	ObjectChat      = "chat.completion"
	ObjectChatChunk = "chat.completion.chunk"
	ObjectText      = "text_completion"
)

// Object is the object name of an endpoint's answer or chunk.
func Object(chat, chunk bool) string {
	switch {
	case chat && chunk:
		return ObjectChatChunk
	case chat:
		return ObjectChat
	}
	return ObjectText
}

// Choice is one choice of a completion or a chunk: Text for completions,
// Message or Delta for chat. Logprobs is *ChatLogprobs or
// *CompletionLogprobs (null when not asked).
type Choice struct {
	Index        int          `json:"index"`
	Text         *string      `json:"text,omitempty"`
	Message      *ChatMessage `json:"message,omitempty"`
	Delta        *ChatMessage `json:"delta,omitempty"`
	Logprobs     any          `json:"logprobs"`
	FinishReason *string      `json:"finish_reason"`
}

// ChatMessage is an assistant message or a streamed delta of one.
type ChatMessage struct {
	Role      string     `json:"role,omitempty"`
	Content   *string    `json:"content,omitempty"`
	ToolCalls []ToolCall `json:"tool_calls,omitempty"`
}

// ChunkMeshgpu is the meshgpu extension of a streamed chunk.
type ChunkMeshgpu struct {
	Token   int32   `json:"token"`
	Logprob float32 `json:"logprob,omitempty"`
	// Top is the token's top alternatives by id (with logprobs on): a
	// tracker's audit compares choices by id, which texts do not name.
	Top []wire.Candidate `json:"top,omitempty"`
}

// ChatLogprobs is a chat choice's logprobs.
type ChatLogprobs struct {
	Content []TokenLogprob `json:"content"`
}

// TokenLogprob is one generated token's logprob and its alternatives.
type TokenLogprob struct {
	Token       string       `json:"token"`
	Logprob     float64      `json:"logprob"`
	Bytes       []int        `json:"bytes"`
	TopLogprobs []TopLogprob `json:"top_logprobs"`
}

// TopLogprob is one alternative of a token.
type TopLogprob struct {
	Token   string  `json:"token"`
	Logprob float64 `json:"logprob"`
	Bytes   []int   `json:"bytes"`
}

// CompletionLogprobs is a completions choice's logprobs (the legacy shape).
type CompletionLogprobs struct {
	Tokens        []string             `json:"tokens"`
	TokenLogprobs []float64            `json:"token_logprobs"`
	TopLogprobs   []map[string]float64 `json:"top_logprobs"`
	TextOffset    []int                `json:"text_offset"`
}

// Bytes is the UTF-8 bytes of s as OpenAI lists them.
func Bytes(s string) []int {
	out := make([]int, len(s))
	for i := 0; i < len(s); i++ {
		out[i] = int(s[i])
	}
	return out
}

// Model is one entry of /v1/models and GET /v1/models/{id}.
type Model struct {
	ID            string `json:"id"`
	Object        string `json:"object"`
	Created       int64  `json:"created"`
	OwnedBy       string `json:"owned_by"`
	ContextLength int    `json:"context_length,omitempty"`
	// Meshgpu is meshgpu's extension, as vLLM adds max_model_len and
	// llama-server meta: OpenAI clients ignore fields they do not know.
	Meshgpu *ModelMeshgpu `json:"meshgpu,omitempty"`
}

// ModelMeshgpu is the meshgpu field of a model entry: the variants that
// serve it: on a tracker those whose nodes cover every layer (sorted by
// label, then fingerprint), on a node its own.
type ModelMeshgpu struct {
	Variants []wire.Variant `json:"variants"`
}

// ModelList is GET /v1/models.
type ModelList struct {
	Object string  `json:"object"`
	Data   []Model `json:"data"`
}

// Finish reasons.
const (
	FinishStop      = "stop"
	FinishLength    = "length"
	FinishToolCalls = "tool_calls"
)
