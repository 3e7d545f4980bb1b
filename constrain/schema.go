// Package constrain restricts sampling to tokens that keep the output a
// prefix of a JSON document matching a schema (OpenAI's response_format
// json_object and json_schema): a byte-level automaton over a practical
// subset of JSON Schema, walked over a trie of the vocabulary's token bytes
// to find the allowed tokens of a step.
//
// The documents it lets through are compact JSON (no whitespace between
// tokens), object properties in the schema's order, numbers without
// exponents. Values the schema leaves open are bounded (Limits) so every
// generation can end.
package constrain

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"sync"
)

// Types a schema node allows (a bit set).
const (
	tObject = 1 << iota
	tArray
	tString
	tNumber
	tInteger
	tBoolean
	tNull
	tAny = tObject | tArray | tString | tNumber | tBoolean | tNull
)

// Limits bound what a schema leaves open.
type Limits struct {
	MaxString     int // bytes of a string without maxLength
	MaxItems      int // items of an array without maxItems
	MaxProperties int // properties of an object without listed properties
	MaxDepth      int // nesting of containers
}

// DefaultLimits are the bounds of values the schema leaves open.
var DefaultLimits = Limits{MaxString: 256, MaxItems: 32, MaxProperties: 16, MaxDepth: 12}

// Node is one compiled schema.
type Node struct {
	types    int
	props    []prop // object: listed properties, in the schema's order
	free     *Node  // object without listed properties: the values' schema
	items    *Node
	minItems int
	maxItems int
	minLen   int
	maxLen   int
	enum     []string // JSON encodings of the allowed values (enum, const)
	// byName makes this a tool call: props are name (an enum of the tool
	// names) and the arguments, whose schema is the named tool's.
	byName map[string]*Node

	minOnce sync.Once
	min     int // minValue

	restOnce             sync.Once
	restBytes, restCount []int // restProps: suffix sums over the required properties
}

// Tool is one function a tool call may name.
type Tool struct {
	Name       string
	Parameters []byte // JSON schema of the arguments; empty: any object
}

// ToolCall is a document {"name":N,"arguments":A} where N is one of tools
// and A matches N's parameters; argsKey names the arguments ("arguments",
// or "parameters" as Llama 3.1 writes them).
func ToolCall(tools []Tool, argsKey string) (*Node, error) {
	n := &Node{types: tObject, byName: map[string]*Node{}, maxItems: -1, maxLen: -1}
	names := &Node{types: tString, maxItems: -1, maxLen: -1}
	for _, t := range tools {
		args := AnyObject()
		if len(bytes.TrimSpace(t.Parameters)) > 0 && string(bytes.TrimSpace(t.Parameters)) != "null" {
			var err error
			if args, err = Compile(t.Parameters); err != nil {
				return nil, fmt.Errorf("tool %s: %v", t.Name, err)
			}
		}
		key, _ := json.Marshal(t.Name)
		names.enum = append(names.enum, string(key))
		n.byName[string(key)] = args
	}
	nameKey, _ := json.Marshal("name")
	argKey, _ := json.Marshal(argsKey)
	n.props = []prop{{name: "name", key: string(nameKey), node: names, required: true},
		{name: argsKey, key: string(argKey), node: AnyObject(), required: true}}
	return n, nil
}

type prop struct {
	name     string
	key      string // its JSON encoding with quotes
	node     *Node
	required bool
}

// keywords the compiler honours; any other is refused rather than ignored,
// since ignoring it could produce documents the schema rejects.
var keywords = map[string]bool{"type": true, "properties": true, "required": true, "additionalProperties": true,
	"items": true, "minItems": true, "maxItems": true, "enum": true, "const": true, "minLength": true, "maxLength": true,
	"title": true, "description": true, "default": true, "examples": true, "format": true, "$schema": true, "$id": true,
	"strict": true}

// AnyObject is response_format json_object: any JSON object.
func AnyObject() *Node {
	any := &Node{types: tAny}
	any.free, any.items = any, any
	return &Node{types: tObject, free: any}
}

// Compile reads a JSON schema (the supported subset); the error names the
// unsupported or malformed part.
func Compile(schema []byte) (*Node, error) {
	return compile(schema, "schema", 0)
}

func compile(raw []byte, path string, depth int) (*Node, error) {
	if depth > 32 {
		return nil, fmt.Errorf("%s: nested more than 32 levels", path)
	}
	raw = bytes.TrimSpace(raw)
	if string(raw) == "true" || string(raw) == "{}" {
		n := &Node{types: tAny}
		n.free, n.items = n, n
		return n, nil
	}
	fields, order, err := objectFields(raw)
	if err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	for _, k := range order {
		if !keywords[k] {
			return nil, fmt.Errorf("%s: keyword %q is not supported (supported: type, properties, required, additionalProperties, items, minItems, maxItems, enum, const, minLength, maxLength)", path, k)
		}
	}
	n := &Node{maxItems: -1, maxLen: -1}
	if t, ok := fields["type"]; ok {
		var one string
		var many []string
		if json.Unmarshal(t, &one) == nil {
			many = []string{one}
		} else if json.Unmarshal(t, &many) != nil {
			return nil, fmt.Errorf("%s.type: want a string or a list of strings", path)
		}
		for _, s := range many {
			bit, ok := map[string]int{"object": tObject, "array": tArray, "string": tString, "number": tNumber | tInteger,
				"integer": tInteger, "boolean": tBoolean, "null": tNull}[s]
			if !ok {
				return nil, fmt.Errorf("%s.type: unknown type %q", path, s)
			}
			n.types |= bit
		}
	} else {
		n.types = tAny
	}
	var values []json.RawMessage
	if e, ok := fields["enum"]; ok {
		if json.Unmarshal(e, &values) != nil || len(values) == 0 {
			return nil, fmt.Errorf("%s.enum: want a non-empty list", path)
		}
	}
	if c, ok := fields["const"]; ok {
		values = append(values, c)
	}
	for _, v := range values {
		var b bytes.Buffer
		if err := json.Compact(&b, v); err != nil {
			return nil, fmt.Errorf("%s.enum: %v", path, err)
		}
		n.enum = append(n.enum, b.String())
	}
	ints := map[string]*int{"minItems": &n.minItems, "maxItems": &n.maxItems, "minLength": &n.minLen, "maxLength": &n.maxLen}
	for k, dst := range ints {
		if v, ok := fields[k]; ok {
			if json.Unmarshal(v, dst) != nil || *dst < 0 {
				return nil, fmt.Errorf("%s.%s: want a non-negative integer", path, k)
			}
		}
	}
	if n.maxLen >= 0 && n.maxLen < n.minLen || n.maxItems >= 0 && n.maxItems < n.minItems {
		return nil, fmt.Errorf("%s: a maximum below its minimum", path)
	}
	required := map[string]bool{}
	if r, ok := fields["required"]; ok {
		var names []string
		if json.Unmarshal(r, &names) != nil {
			return nil, fmt.Errorf("%s.required: want a list of names", path)
		}
		for _, s := range names {
			required[s] = true
		}
	}
	if p, ok := fields["properties"]; ok {
		pf, porder, err := objectFields(p)
		if err != nil {
			return nil, fmt.Errorf("%s.properties: %v", path, err)
		}
		for _, name := range porder {
			child, err := compile(pf[name], path+".properties."+name, depth+1)
			if err != nil {
				return nil, err
			}
			key, _ := json.Marshal(name)
			n.props = append(n.props, prop{name: name, key: string(key), node: child, required: required[name]})
			delete(required, name)
		}
	}
	if len(required) > 0 {
		var missing []string
		for k := range required {
			missing = append(missing, k)
		}
		sort.Strings(missing)
		return nil, fmt.Errorf("%s.required: %s not among the properties", path, strings.Join(missing, ", "))
	}
	if len(n.props) == 0 {
		n.free = &Node{types: tAny}
		n.free.free, n.free.items = n.free, n.free
		if a, ok := fields["additionalProperties"]; ok {
			if string(bytes.TrimSpace(a)) == "false" {
				n.free = nil // only {}
			} else if child, err := compile(a, path+".additionalProperties", depth+1); err != nil {
				return nil, err
			} else {
				n.free = child
			}
		}
	}
	n.items = &Node{types: tAny}
	n.items.free, n.items.items = n.items, n.items
	if it, ok := fields["items"]; ok {
		if n.items, err = compile(it, path+".items", depth+1); err != nil {
			return nil, err
		}
	}
	return n, nil
}

// objectFields decodes a JSON object keeping its key order.
func objectFields(raw []byte) (map[string]json.RawMessage, []string, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	tok, err := dec.Token()
	if err != nil || tok != json.Delim('{') {
		return nil, nil, fmt.Errorf("want a JSON object")
	}
	fields := map[string]json.RawMessage{}
	var order []string
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return nil, nil, err
		}
		k, _ := t.(string)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, nil, err
		}
		if _, dup := fields[k]; !dup {
			order = append(order, k)
		}
		fields[k] = v
	}
	return fields, order, nil
}
