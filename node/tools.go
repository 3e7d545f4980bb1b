package node

import (
	"bytes"
	"encoding/json"
	"strings"

	"meshgpu/model/chat"
	"meshgpu/openai"
)

// Tools: a chat template that renders tools gets them; the model's calls,
// written in the template's syntax (chat.Template.ToolSyntax), come back as
// tool_calls with finish_reason "tool_calls". With tool_choice "required"
// or a named function the call is forced and its arguments constrained by
// the tool's schema (a tool_call response format); with "auto" the model
// may answer or call, and a call it starts is constrained the same way
// (a triggered tool_call format). The output is then parsed.

// toolSyntax is how the job's model writes tool calls.
type toolSyntax struct {
	prefix, suffix, argsKey string
	names                   map[string]bool
}

// templateTools is req.Tools as the decoded JSON a template expects.
func templateTools(req *openai.Request) []any {
	out := make([]any, len(req.Tools))
	for i, t := range req.Tools {
		f := map[string]any{"name": t.Function.Name}
		if t.Function.Description != "" {
			f["description"] = t.Function.Description
		}
		if len(t.Function.Parameters) > 0 {
			var p any
			dec := json.NewDecoder(bytes.NewReader(t.Function.Parameters))
			dec.UseNumber()
			if dec.Decode(&p) == nil {
				f["parameters"] = p
			}
		}
		out[i] = map[string]any{"type": "function", "function": f}
	}
	return out
}

// templateMessages converts the request's messages, with their tool calls
// (arguments decoded: templates print them with tojson) and tool answers.
func templateMessages(req *openai.Request) []chat.Message {
	msgs := make([]chat.Message, len(req.Messages))
	for i, m := range req.Messages {
		msgs[i] = chat.Message{Role: m.Role, Content: req.Texts[i], ToolCallID: m.ToolCallID}
		for _, c := range m.ToolCalls {
			var args any = c.Function.Arguments
			var obj any
			if json.Unmarshal([]byte(c.Function.Arguments), &obj) == nil {
				args = obj
			}
			msgs[i].ToolCalls = append(msgs[i].ToolCalls, chat.ToolCall{ID: c.ID, Name: c.Function.Name, Arguments: args})
		}
	}
	return msgs
}

// forcedToolFormat is the response format of a forced call.
func forcedToolFormat(req *openai.Request, ts *toolSyntax) formatSpec {
	f := formatSpec{Type: "tool_call", Prefix: ts.prefix, Suffix: ts.suffix, ArgsKey: ts.argsKey}
	for _, t := range req.Tools {
		if req.ToolName == "" || t.Function.Name == req.ToolName {
			var b bytes.Buffer
			json.Compact(&b, t.Function.Parameters)
			f.Tools = append(f.Tools, toolSpec{Name: t.Function.Name, Parameters: b.Bytes()})
		}
	}
	return f
}

// parseToolCalls finds the calls in a generated text: each a JSON object
// {"name": one of the tools, argsKey: {...}} between the syntax's prefix
// and suffix (bare JSON: the whole text). content is what is left, nil
// when nothing is.
func parseToolCalls(text string, ts *toolSyntax) (content *string, calls []openai.ToolCall) {
	parse := func(doc string) bool {
		var call map[string]json.RawMessage
		if json.Unmarshal([]byte(strings.TrimSpace(doc)), &call) != nil {
			return false
		}
		var name string
		if json.Unmarshal(call["name"], &name) != nil || !ts.names[name] {
			return false
		}
		args := call[ts.argsKey]
		if len(args) == 0 {
			args = call["arguments"]
		}
		if len(args) == 0 {
			args = json.RawMessage("{}")
		}
		var b bytes.Buffer
		if json.Compact(&b, args) != nil {
			return false
		}
		idx := len(calls)
		calls = append(calls, openai.ToolCall{Index: &idx, ID: openai.NewID("call_"), Type: "function",
			Function: openai.ToolCallFunction{Name: name, Arguments: b.String()}})
		return true
	}
	rest := text
	if ts.prefix == "" {
		if !parse(text) {
			return &text, nil
		}
		return nil, calls
	}
	var left strings.Builder
	for {
		i := strings.Index(rest, ts.prefix)
		if i < 0 {
			left.WriteString(rest)
			break
		}
		end := strings.Index(rest[i+len(ts.prefix):], strings.TrimSpace(ts.suffix))
		if end < 0 {
			left.WriteString(rest)
			break
		}
		doc := rest[i+len(ts.prefix) : i+len(ts.prefix)+end]
		if !parse(doc) {
			left.WriteString(rest[:i+len(ts.prefix)+end+len(strings.TrimSpace(ts.suffix))])
		} else {
			left.WriteString(rest[:i])
		}
		rest = rest[i+len(ts.prefix)+end+len(strings.TrimSpace(ts.suffix)):]
	}
	if s := strings.TrimSpace(left.String()); s != "" {
		return &s, calls
	}
	return nil, calls
}
