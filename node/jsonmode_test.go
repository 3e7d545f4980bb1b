package node

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"meshgpu/internal/schemacheck"
	"meshgpu/internal/testenv"
)

// JSON mode on every golden prompt, sampled on the tail of a three-node
// mesh: json_object and each test schema (constrain/testdata), greedy and
// seeded, streamed and not, always end with finish "stop" in a document
// that parses and that an independent checker validates.
func TestJSONModeOnGoldenPrompts(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 120 * time.Second}
	defer c.CloseIdleConnections()
	b, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "constrain", "testdata", "schemas.json"))
	if err != nil {
		t.Fatal(err)
	}
	var schemas []json.RawMessage
	if err := json.Unmarshal(b, &schemas); err != nil {
		t.Fatal(err)
	}
	formats := []map[string]any{{"type": "json_object"}}
	for i, s := range schemas {
		formats = append(formats, map[string]any{"type": "json_schema", "json_schema": map[string]any{"name": "s" + string(rune('a'+i)), "schema": s}})
	}
	for pi, gen := range g.golden {
		for fi, f := range formats {
			var schema map[string]any
			if fi == 0 {
				schema = map[string]any{"type": "object"}
			} else {
				json.Unmarshal(schemas[fi-1], &schema)
			}
			for _, mode := range []struct {
				temp   float64
				stream bool
			}{{0, false}, {0.9, true}} {
				body := map[string]any{"messages": []map[string]any{{"role": "user", "content": gen.Prompt}}, "response_format": f,
					"max_tokens": 600, "temperature": mode.temp, "seed": 5, "stream": mode.stream}
				text, finish := chatText(t, c, g.url, body)
				var v any
				if err := json.Unmarshal([]byte(text), &v); err != nil || finish != "stop" {
					t.Errorf("prompt %d format %d temp %v: finish %q, %q does not parse: %v", pi, fi, mode.temp, finish, text, err)
					continue
				}
				if err := schemacheck.Validate(schema, v); err != nil {
					t.Errorf("prompt %d format %d temp %v: %s: %v", pi, fi, mode.temp, text, err)
				}
			}
		}
	}
}

// A small max_tokens still ends in a complete document: closing starts
// when the tokens left need it.
func TestJSONModeClosesWithinMaxTokens(t *testing.T) {
	testenv.CheckGoroutines(t)
	g := startGocoderMesh(t)
	c := &http.Client{Timeout: 120 * time.Second}
	defer c.CloseIdleConnections()
	for _, max := range []int{3, 8, 20, 40} {
		for _, gen := range g.golden {
			text, finish := chatText(t, c, g.url, map[string]any{"messages": []map[string]any{{"role": "user", "content": gen.Prompt}},
				"response_format": map[string]any{"type": "json_object"}, "max_tokens": max, "temperature": 1.2, "seed": 9})
			var v map[string]any
			if err := json.Unmarshal([]byte(text), &v); err != nil || finish != "stop" {
				t.Errorf("max_tokens %d: finish %q, %q: %v", max, finish, text, err)
			}
		}
	}
}

// chatText posts a chat request and returns the content and finish reason.
func chatText(t *testing.T, c *http.Client, base string, body map[string]any) (string, string) {
	t.Helper()
	msg, finish := toolAnswer(t, c, base, body)
	if msg.Content == nil {
		return "", finish
	}
	return *msg.Content, finish
}
