// Package schemacheck validates decoded JSON against the subset of JSON
// Schema that meshgpu/constrain supports. It is for tests: written from the
// JSON Schema specification, independently of the automaton it checks.
package schemacheck

import (
	"encoding/json"
	"fmt"
)

// Validate is an independent check of a decoded document against the
// schema subset, written from the JSON Schema specification (not from the
// automaton).
func Validate(schema map[string]any, v any) error {
	if t, ok := schema["type"]; ok {
		types := []any{t}
		if l, ok := t.([]any); ok {
			types = l
		}
		match := false
		for _, t := range types {
			switch t {
			case "object":
				_, match2 := v.(map[string]any)
				match = match || match2
			case "array":
				_, match2 := v.([]any)
				match = match || match2
			case "string":
				_, match2 := v.(string)
				match = match || match2
			case "number":
				_, match2 := v.(float64)
				match = match || match2
			case "integer":
				f, match2 := v.(float64)
				match = match || match2 && f == float64(int64(f))
			case "boolean":
				_, match2 := v.(bool)
				match = match || match2
			case "null":
				match = match || v == nil
			}
		}
		if !match {
			return fmt.Errorf("%v is not of type %v", v, t)
		}
	}
	if e, ok := schema["enum"].([]any); ok {
		found := false
		for _, c := range e {
			a, _ := json.Marshal(c)
			b, _ := json.Marshal(v)
			found = found || string(a) == string(b)
		}
		if !found {
			return fmt.Errorf("%v not in enum %v", v, e)
		}
	}
	if s, ok := v.(string); ok {
		n := len([]rune(s))
		if m, ok := schema["maxLength"].(float64); ok && float64(n) > m {
			return fmt.Errorf("%q longer than %v", s, m)
		}
		if m, ok := schema["minLength"].(float64); ok && float64(n) < m {
			return fmt.Errorf("%q shorter than %v", s, m)
		}
	}
	if obj, ok := v.(map[string]any); ok {
		props, _ := schema["properties"].(map[string]any)
		for _, r := range asList(schema["required"]) {
			if _, ok := obj[r.(string)]; !ok {
				return fmt.Errorf("required %v missing in %v", r, obj)
			}
		}
		for k, val := range obj {
			if ps, ok := props[k].(map[string]any); ok {
				if err := Validate(ps, val); err != nil {
					return fmt.Errorf("%s: %v", k, err)
				}
			} else if props != nil || schema["additionalProperties"] == false {
				if schema["additionalProperties"] == false {
					return fmt.Errorf("property %q not allowed", k)
				}
			} else if ap, ok := schema["additionalProperties"].(map[string]any); ok {
				if err := Validate(ap, val); err != nil {
					return err
				}
			}
		}
	}
	if arr, ok := v.([]any); ok {
		if m, ok := schema["maxItems"].(float64); ok && float64(len(arr)) > m {
			return fmt.Errorf("%d items, max %v", len(arr), m)
		}
		if m, ok := schema["minItems"].(float64); ok && float64(len(arr)) < m {
			return fmt.Errorf("%d items, min %v", len(arr), m)
		}
		if it, ok := schema["items"].(map[string]any); ok {
			for _, x := range arr {
				if err := Validate(it, x); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

func asList(v any) []any { l, _ := v.([]any); return l }
