package constrain

import (
	"encoding/json"
	"math/rand"
	"os"
	"strings"
	"testing"

	"meshgpu/internal/schemacheck"
	"meshgpu/sample"
)

// Schemas of the tests (also used by the node's golden-prompt test).
// testSchemas are testdata/schemas.json (also used by the node's test of
// JSON mode on the golden prompts).
var testSchemas = func() []string {
	b, err := os.ReadFile("testdata/schemas.json")
	if err != nil {
		panic(err)
	}
	var list []json.RawMessage
	if err := json.Unmarshal(b, &list); err != nil {
		panic(err)
	}
	out := make([]string, len(list))
	for i, r := range list {
		out[i] = string(r)
	}
	return out
}()

// Random walks of the automaton over bytes end in documents that parse and
// validate; and a document it finishes is never a prefix it could extend
// into an invalid one.
func TestRandomDocumentsValidate(t *testing.T) {
	var alphabet []byte
	for c := 0; c < 256; c++ {
		alphabet = append(alphabet, byte(c)) // every byte: the automaton must refuse the wrong ones
	}
	rng := rand.New(rand.NewSource(1))
	schemas := append([]string{"json_object"}, testSchemas...)
	for si, src := range schemas {
		var n *Node
		var schema map[string]any
		if src == "json_object" {
			n, schema = AnyObject(), map[string]any{"type": "object"}
		} else {
			var err error
			if n, err = Compile([]byte(src)); err != nil {
				t.Fatalf("schema %d: %v", si, err)
			}
			json.Unmarshal([]byte(src), &schema)
		}
		done := 0
		for trial := 0; trial < 300; trial++ {
			st := NewState(n, Limits{MaxString: 8, MaxItems: 3, MaxProperties: 3, MaxDepth: 4})
			var doc []byte
			for steps := 0; steps < 400 && !st.Done(); steps++ {
				if st.CanEnd() && rng.Intn(4) == 0 {
					break
				}
				// try bytes in random order until one is accepted
				ok := false
				for _, i := range rng.Perm(len(alphabet)) {
					next := st.Clone()
					if next.Step(alphabet[i]) {
						st, doc, ok = next, append(doc, alphabet[i]), true
						break
					}
				}
				if !ok {
					t.Fatalf("schema %d: stuck after %q", si, doc)
				}
			}
			if !st.CanEnd() {
				continue // ran out of steps
			}
			done++
			var v any
			if err := json.Unmarshal(doc, &v); err != nil {
				t.Fatalf("schema %d: %q does not parse: %v", si, doc, err)
			}
			if err := schemacheck.Validate(schema, v); err != nil {
				t.Fatalf("schema %d: %q: %v", si, doc, err)
			}
		}
		if done < 100 {
			t.Errorf("schema %d: only %d of 300 walks finished", si, done)
		}
	}
}

// Known documents: valid compact ones are accepted byte by byte; invalid
// ones are refused at some byte.
func TestKnownDocuments(t *testing.T) {
	n, err := Compile([]byte(testSchemas[0]))
	if err != nil {
		t.Fatal(err)
	}
	accept := func(doc string) bool {
		st := NewState(n, DefaultLimits)
		for i := 0; i < len(doc); i++ {
			if !st.Step(doc[i]) {
				return false
			}
		}
		return st.CanEnd()
	}
	for _, doc := range []string{`{"name":"ab","count":3}`, `{"name":"","count":-10,"ok":true}`, `{"name":"\u00e9\n","count":0}`} {
		if !accept(doc) {
			t.Errorf("refused %s", doc)
		}
	}
	for _, doc := range []string{`{"count":3,"name":"ab"}` /* order */, `{"name":"ab"}`, `{"name":"ab","count":3.5}`,
		`{"name":"0123456789abc","count":1}`, `{"name":"ab","count":1,"x":1}`, `{"name":"ab","count":01}`, `{"name":"a` + "\n" + `","count":1}`, `[1]`} {
		if accept(doc) {
			t.Errorf("accepted %s", doc)
		}
	}
	if _, err := Compile([]byte(`{"type":"string","pattern":"^a"}`)); err == nil || !strings.Contains(err.Error(), "pattern") {
		t.Errorf("pattern not refused: %v", err)
	}
	if _, err := Compile([]byte(`{"type":"object","required":["x"]}`)); err == nil {
		t.Error("required property not among properties accepted")
	}
}

// The trie walk allows exactly the tokens whose bytes the automaton
// accepts one by one (checked token by token, without the trie).
func TestAllowedMatchesTokenByToken(t *testing.T) {
	rng := rand.New(rand.NewSource(2))
	alphabet := []byte(`{}[],:"-0123456789.truefalsnabc `)
	tokens := make([][]byte, 3000)
	for i := range tokens {
		if i%500 == 7 {
			continue // special tokens: no bytes
		}
		b := make([]byte, 1+rng.Intn(5))
		for k := range b {
			b[k] = alphabet[rng.Intn(len(alphabet))]
		}
		tokens[i] = b
	}
	eos := []int32{7}
	v := NewVocab(tokens, eos)
	n, _ := Compile([]byte(testSchemas[1]))
	allowed := make([]bool, len(tokens))
	for _, prefix := range []string{``, `{`, `{"color":"re`, `{"color":"red","tags":[`, `{"color":"red","tags":["a"],"score":1`, `{"color":"red","tags":["a"]}`} {
		st := NewState(n, DefaultLimits)
		for i := 0; i < len(prefix); i++ {
			if !st.Step(prefix[i]) {
				t.Fatalf("prefix %q refused", prefix)
			}
		}
		count := v.Allowed(st, allowed, -1)
		got := 0
		for id, b := range tokens {
			want := false
			if id == 7 {
				want = st.CanEnd()
			} else if len(b) > 0 {
				c := st.Clone()
				want = true
				for _, x := range b {
					if !c.Step(x) {
						want = false
						break
					}
				}
			}
			if allowed[id] != want {
				t.Fatalf("prefix %q: token %d %q allowed %v, want %v", prefix, id, b, allowed[id], want)
			}
			if want {
				got++
			}
		}
		if got != count {
			t.Errorf("prefix %q: count %d, want %d", prefix, count, got)
		}
	}
}

// BenchmarkAllowed128k finds the allowed tokens of a 128k-token vocabulary
// inside a string (the worst case: nearly every token is allowed) and
// after '{' (few are); the baseline, in the same run, is one unconstrained
// draw from 128k logits (sample.Sample at temperature 1). Random tokens of
// 1-7 printable bytes share fewer prefixes than a real BPE vocabulary, so
// the trie is larger than a real one.
func BenchmarkAllowed128k(b *testing.B) {
	logits := make([]float32, 128000)
	for i := range logits {
		logits[i] = float32(i%977) / 100
	}
	b.Run("baseline-sample", func(b *testing.B) {
		work := make([]float32, len(logits))
		for i := 0; i < b.N; i++ {
			copy(work, logits)
			sample.Sample(work, sample.Params{Temperature: 1, Seed: 1}, nil, i)
		}
	})
	rng := rand.New(rand.NewSource(3))
	tokens := make([][]byte, 128000)
	for i := range tokens {
		t := make([]byte, 1+rng.Intn(7))
		for k := range t {
			t[k] = byte(32 + rng.Intn(95))
		}
		tokens[i] = t
	}
	v := NewVocab(tokens, []int32{0})
	allowed := make([]bool, len(tokens))
	for _, tc := range []struct{ name, prefix string }{{"in-string", `{"a`}, {"after-brace", `{`}} {
		b.Run(tc.name, func(b *testing.B) {
			st := NewState(AnyObject(), DefaultLimits)
			for i := 0; i < len(tc.prefix); i++ {
				st.Step(tc.prefix[i])
			}
			for i := 0; i < b.N; i++ {
				v.Allowed(st, allowed, -1)
			}
		})
	}
}

// From every state of random walks, the closing cost is achievable: some
// byte lowers it by one, and closing that way ends the document after
// exactly Cost bytes (what the budget of Allowed relies on).
func TestCostClosesExactly(t *testing.T) {
	var alphabet []byte
	for c := 0x20; c < 0x7F; c++ {
		alphabet = append(alphabet, byte(c))
	}
	rng := rand.New(rand.NewSource(4))
	for si, src := range append([]string{""}, testSchemas...) {
		n := AnyObject()
		if src != "" {
			n, _ = Compile([]byte(src))
		}
		for trial := 0; trial < 100; trial++ {
			st := NewState(n, DefaultLimits)
			var doc []byte
			for steps := 0; steps < 60 && !st.Done(); steps++ {
				// close from here
				c, closing := st.Cost(), st.Clone()
				var closed []byte
				for k := 0; k < c; k++ {
					moved := false
					for _, b := range alphabet {
						next := closing.Clone()
						if next.Step(b) && next.Cost() == closing.Cost()-1 {
							closing, moved = next, true
							closed = append(closed, b)
							break
						}
					}
					if !moved {
						t.Fatalf("schema %d: after %q then %q no byte lowers the cost %d", si, doc, closed, closing.Cost())
					}
				}
				if !closing.CanEnd() {
					t.Fatalf("schema %d: %d closing bytes did not end the document", si, c)
				}
				// then a random byte onwards
				for _, i := range rng.Perm(len(alphabet)) {
					next := st.Clone()
					if next.Step(alphabet[i]) {
						st = next
						doc = append(doc, alphabet[i])
						break
					}
				}
			}
		}
	}
}

// A tool call names one of the tools and its arguments match that tool's
// schema, between the template's prefix and suffix.
func TestToolCallDocuments(t *testing.T) {
	tools := []Tool{{Name: "get_weather", Parameters: []byte(testSchemas[0])}, {Name: "noop"}}
	n, err := ToolCall(tools, "arguments")
	if err != nil {
		t.Fatal(err)
	}
	var alphabet []byte
	for c := 0; c < 256; c++ {
		alphabet = append(alphabet, byte(c))
	}
	var schema0 map[string]any
	json.Unmarshal([]byte(testSchemas[0]), &schema0)
	rng := rand.New(rand.NewSource(5))
	seen := map[string]int{}
	for trial := 0; trial < 200; trial++ {
		st := NewWrapped(n, Limits{MaxString: 6, MaxItems: 2, MaxProperties: 2, MaxDepth: 3}, "<tool_call>\n", "\n</tool_call>")
		var doc []byte
		for steps := 0; steps < 500 && !st.Done(); steps++ {
			for _, i := range rng.Perm(len(alphabet)) {
				next := st.Clone()
				if next.Step(alphabet[i]) {
					st, doc = next, append(doc, alphabet[i])
					break
				}
			}
		}
		if !st.Done() || !st.CanEnd() {
			continue
		}
		body, ok := strings.CutPrefix(string(doc), "<tool_call>\n")
		body, ok2 := strings.CutSuffix(body, "\n</tool_call>")
		var call struct {
			Name      string         `json:"name"`
			Arguments map[string]any `json:"arguments"`
		}
		if !ok || !ok2 || json.Unmarshal([]byte(body), &call) != nil {
			t.Fatalf("%q is not a wrapped tool call", doc)
		}
		seen[call.Name]++
		switch call.Name {
		case "get_weather":
			if err := schemacheck.Validate(schema0, call.Arguments); err != nil {
				t.Fatalf("%q: %v", doc, err)
			}
		case "noop":
		default:
			t.Fatalf("%q names no tool", doc)
		}
	}
	if seen["get_weather"] < 20 || seen["noop"] < 20 {
		t.Errorf("calls by name: %v", seen)
	}
}

// Free text with tool calls: any text, but what follows the trigger is a
// call whose arguments match the named tool, closed by the suffix; the text
// may end only outside a call.
func TestTriggeredToolCalls(t *testing.T) {
	tools := []Tool{{Name: "add", Parameters: []byte(`{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"additionalProperties":false}`)}}
	n, err := ToolCall(tools, "arguments")
	if err != nil {
		t.Fatal(err)
	}
	run := func(text string) (*State, bool) {
		st := NewTriggered(n, DefaultLimits, "<tool_call>\n", "\n</tool_call>")
		for i := 0; i < len(text); i++ {
			if !st.Step(text[i]) {
				return st, false
			}
		}
		return st, true
	}
	for _, tc := range []struct {
		text       string
		ok, canEnd bool
	}{
		{"Sure, <tool_ and more text", true, true},
		{"x <tool_call>\n{\"name\":\"add\",\"arguments\":{\"a\":1}}\n</tool_call> done", true, true},
		{"x <tool_call>\n{\"name\":\"add\",\"arguments\":{\"a\":1}}", true, false},
		{"<tool_call>\n{\"name\":\"sub\"", false, false},
		{"<tool_call>\n{\"name\":\"add\",\"arguments\":{\"b\":1}}", false, false},
		{"<<tool_call>\n{\"name\":\"add\",\"arguments\":{\"a\":2}}\n</tool_call>", true, true},
	} {
		st, ok := run(tc.text)
		if ok != tc.ok || ok && st.CanEnd() != tc.canEnd {
			t.Errorf("%q: ok %v can end %v, want %v %v", tc.text, ok, ok && st.CanEnd(), tc.ok, tc.canEnd)
		}
	}
}
