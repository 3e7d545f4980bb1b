package node

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"sync"

	"meshgpu/constrain"
	"meshgpu/sample"
)

// JSON mode (response_format) by constrained decoding, on the node that
// samples: the head sends the format with every step's sampling parameters
// and the ids fed (as for the penalties), so this node replays the
// generated ids through the schema's automaton and masks the logits to the
// tokens that keep the output a valid prefix. The mask is a pure function
// of (format, generated ids): retried hops and replays get the same one,
// and the draw stays a function of (seed, step, logits).

// formatSpec is the response format sent in sample.Params.ResponseFormat.
type formatSpec struct {
	Type   string          `json:"type"` // json_object, json_schema or tool_call
	Schema json.RawMessage `json:"schema,omitempty"`
	// tool_call: {"name": one of Tools, ArgsKey: its parameters} between
	// Prefix and Suffix (the chat template's syntax).
	Tools   []toolSpec `json:"tools,omitempty"`
	Prefix  string     `json:"prefix,omitempty"`
	Suffix  string     `json:"suffix,omitempty"`
	ArgsKey string     `json:"args_key,omitempty"`
	// Trigger (tool_choice "auto"): free text, in which each Prefix starts
	// a constrained call.
	Trigger bool `json:"trigger,omitempty"`
	// MaxSteps is the generation's last step + 1 (continued ids and
	// max_tokens): the document must be complete in time for the end token
	// to fit, so closing starts when the steps left need it. 0: no limit.
	MaxSteps int `json:"max_steps,omitempty"`
}

// toolSpec is a function a forced tool call may name.
type toolSpec struct {
	Name       string          `json:"name"`
	Parameters json.RawMessage `json:"parameters,omitempty"`
}

// constraints caches the vocabulary trie and compiled schemas of a server.
type constraints struct {
	once  sync.Once
	vocab *constrain.Vocab
	err   error

	mu      sync.Mutex
	schemas map[string]*constrain.Node
}

const maxCachedSchemas = 64

// compileFormat checks and compiles a format (the head calls it to refuse a
// bad schema before generating).
func compileFormat(raw []byte) (*constrain.Node, error) {
	var f formatSpec
	if err := json.Unmarshal(raw, &f); err != nil {
		return nil, fmt.Errorf("response_format: %v", err)
	}
	switch f.Type {
	case "json_object":
		return constrain.AnyObject(), nil
	case "json_schema":
		return constrain.Compile(f.Schema)
	case "tool_call":
		tools := make([]constrain.Tool, len(f.Tools))
		for i, t := range f.Tools {
			tools[i] = constrain.Tool{Name: t.Name, Parameters: t.Parameters}
		}
		if len(tools) == 0 || f.ArgsKey == "" || f.Trigger && f.Prefix == "" {
			return nil, fmt.Errorf("a tool_call format needs tools and args_key (and a prefix with trigger)")
		}
		return constrain.ToolCall(tools, f.ArgsKey)
	}
	return nil, fmt.Errorf("response_format type %q is not json_object or json_schema", f.Type)
}

func (c *constraints) schema(raw []byte) (*constrain.Node, formatSpec, error) {
	var f formatSpec
	if err := json.Unmarshal(raw, &f); err != nil {
		return nil, f, fmt.Errorf("response_format: %v", err)
	}
	tools, _ := json.Marshal(f.Tools)
	key := f.Type + "\x00" + string(f.Schema) + "\x00" + string(tools) + "\x00" + f.ArgsKey
	c.mu.Lock()
	defer c.mu.Unlock()
	if n, ok := c.schemas[key]; ok {
		return n, f, nil
	}
	n, err := compileFormat(raw)
	if err != nil {
		return nil, f, err
	}
	if c.schemas == nil || len(c.schemas) >= maxCachedSchemas {
		c.schemas = map[string]*constrain.Node{}
	}
	c.schemas[key] = n
	return n, f, nil
}

// vocabulary builds the trie of the model's tokens once.
func (s *Server) vocabulary() (*constrain.Vocab, error) {
	c := &s.constraints
	c.once.Do(func() {
		if s.Model == nil || s.Model.Tokenizer == nil {
			c.err = fmt.Errorf("this node has no tokenizer to constrain the output with")
			return
		}
		tok := s.Model.Tokenizer
		tokens := make([][]byte, s.cfg.Vocab)
		for id := range tokens {
			if tok.IsSpecial(int32(id)) {
				continue
			}
			tokens[id] = []byte(tok.Decode([]int32{int32(id)}, false))
		}
		c.vocab = constrain.NewVocab(tokens, s.Model.EOS())
	})
	return c.vocab, c.err
}

// maskFormat sets the logits of tokens the format does not allow after the
// generated ids (the last step ids of history) to -Inf.
func (s *Server) maskFormat(logits []float32, p sample.Params, history []int32, step int) *apiError {
	node, spec, err := s.constraints.schema(p.ResponseFormat)
	if err != nil {
		return &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Param: "response_format", Message: err.Error()}
	}
	if step > len(history) {
		return &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error",
			Message: fmt.Sprintf("step %d but only %d ids of history: send the tokens with the sampling parameters", step, len(history))}
	}
	v, err := s.vocabulary()
	if err != nil {
		return &apiError{Status: http.StatusInternalServerError, Type: "backend_error", Message: err.Error()}
	}
	st := constrain.NewWrapped(node, constrain.DefaultLimits, spec.Prefix, spec.Suffix)
	if spec.Trigger {
		st = constrain.NewTriggered(node, constrain.DefaultLimits, spec.Prefix, spec.Suffix)
	}
	if !v.Replay(st, history[len(history)-step:]) {
		return &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error",
			Message: "the generated ids do not fit the response format"}
	}
	budget := -1
	if spec.MaxSteps > 0 {
		// this token, the closing ones, then the end token by step MaxSteps-1
		budget = spec.MaxSteps - step - 2
	}
	allowed := make([]bool, v.Size())
	if budget < -1 || v.Allowed(st, allowed, max(budget, 0)) == 0 {
		// the vocabulary cannot continue the document: end it
		for _, id := range s.Model.EOS() {
			if int(id) < len(allowed) {
				allowed[id] = true
			}
		}
	}
	neg := float32(math.Inf(-1))
	for id := range logits {
		if id >= len(allowed) || !allowed[id] {
			logits[id] = neg
		}
	}
	return nil
}
