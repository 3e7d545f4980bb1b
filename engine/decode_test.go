package engine

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/model/tokenizer"
)

// fixedStepper returns ids[step] and records what it was fed.
type fixedStepper struct {
	ids   []int32
	calls [][3]int // pos, len(tokens), step
	fed   []int32
}

func (f *fixedStepper) step(ctx context.Context, pos int, tokens []int32, step int) (int32, float32, error) {
	if err := ctx.Err(); err != nil {
		return 0, 0, err
	}
	f.calls = append(f.calls, [3]int{pos, len(tokens), step})
	f.fed = append(f.fed, tokens...)
	return f.ids[step], -0.5, nil
}

func tokenizerOf(t *testing.T) *tokenizer.Tokenizer {
	tok, err := tokenizer.Load(testenv.GoCoder(t))
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func TestDecodeStopsAndStreams(t *testing.T) {
	tok := tokenizerOf(t)
	text := "func main() {\n\tfmt.Println(\"héllo, 世界\")\n}\n// END here\nmore"
	ids := tok.Encode(text, false)
	prompt := []int32{0, 343}
	decoded := tok.Decode(ids, true)

	collect := func(p GenerateParams, eos []int32, f *fixedStepper) (*Result, string, []Token) {
		var streamed strings.Builder
		var toks []Token
		res, err := Decode(context.Background(), tok, eos, prompt, p, f.step, func(tk Token) error {
			streamed.WriteString(tk.Text)
			toks = append(toks, tk)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return res, streamed.String(), toks
	}

	// no stop: length; streamed == text == Decode(ids); positions advance by one
	f := &fixedStepper{ids: ids}
	res, streamed, _ := collect(GenerateParams{MaxTokens: len(ids)}, nil, f)
	if res.FinishReason != FinishLength || res.Text != decoded || streamed != decoded || !slices.Equal(res.IDs, ids) {
		t.Errorf("length: finish %q text %q streamed %q", res.FinishReason, res.Text, streamed)
	}
	if f.calls[0] != [3]int{0, 2, 0} || f.calls[1] != [3]int{2, 1, 1} || f.calls[len(f.calls)-1][0] != len(prompt)+len(ids)-2 {
		t.Errorf("stepper calls %v", f.calls[:3])
	}

	// stop strings: the earliest one wins, output cut before it, never streamed
	for _, stops := range [][]string{{"// END"}, {"here", "// E"}, {"Println"}, {"世界"}, {"\n}\n"}} {
		f := &fixedStepper{ids: ids}
		res, streamed, _ := collect(GenerateParams{MaxTokens: len(ids), Stop: stops}, nil, f)
		cut := len(decoded)
		for _, s := range stops {
			if i := strings.Index(decoded, s); i >= 0 && i < cut {
				cut = i
			}
		}
		if res.FinishReason != FinishStop || res.Text != decoded[:cut] || streamed != decoded[:cut] {
			t.Errorf("stop %q: finish %q text %q streamed %q, want %q", stops, res.FinishReason, res.Text, streamed, decoded[:cut])
		}
	}

	// a stop string that never completes is released at the end
	f = &fixedStepper{ids: ids}
	res, streamed, toks := collect(GenerateParams{MaxTokens: len(ids), Stop: []string{"more!"}}, nil, f)
	if res.Text != decoded || streamed != decoded || toks[len(toks)-1].ID != -1 && !strings.HasSuffix(decoded, toks[len(toks)-1].Text) {
		t.Errorf("unfinished stop: text %q streamed %q", res.Text, streamed)
	}

	// EOS ends with "stop" and is not part of the output; IgnoreEOS goes on
	eos := ids[5]
	f = &fixedStepper{ids: ids}
	res, _, _ = collect(GenerateParams{MaxTokens: len(ids)}, []int32{eos}, f)
	if res.FinishReason != FinishStop || !slices.Equal(res.IDs, ids[:5]) || res.Text != tok.Decode(ids[:5], true) {
		t.Errorf("eos: finish %q ids %v", res.FinishReason, res.IDs)
	}
	f = &fixedStepper{ids: ids}
	res, _, _ = collect(GenerateParams{MaxTokens: 10, IgnoreEOS: true}, []int32{eos}, f)
	if res.FinishReason != FinishLength || len(res.IDs) != 10 {
		t.Errorf("ignore eos: finish %q, %d ids", res.FinishReason, len(res.IDs))
	}
}

func TestDecodeErrors(t *testing.T) {
	tok := tokenizerOf(t)
	ids := tok.Encode("abcdefghijklmnopqrstuvwxyz", false)
	ctx, cancel := context.WithCancel(context.Background())
	n := 0
	_, err := Decode(ctx, tok, nil, []int32{0}, GenerateParams{MaxTokens: 20}, (&fixedStepper{ids: ids}).step, func(Token) error {
		if n++; n == 3 {
			cancel()
		}
		return nil
	})
	if !errors.Is(err, context.Canceled) {
		t.Errorf("cancel: %v", err)
	}
	boom := errors.New("client went away")
	_, err = Decode(context.Background(), tok, nil, []int32{0}, GenerateParams{MaxTokens: 20}, (&fixedStepper{ids: ids}).step, func(Token) error { return boom })
	if !errors.Is(err, boom) {
		t.Errorf("onToken error: %v", err)
	}
	for _, p := range []GenerateParams{{MaxTokens: 0}, {MaxTokens: 5, Stop: []string{""}}, {MaxTokens: 5, Stop: make([]string, 100)}} {
		if _, err := Decode(context.Background(), tok, nil, []int32{0}, p, (&fixedStepper{ids: ids}).step, nil); err == nil {
			t.Errorf("%+v: no error", p)
		}
	}
	if _, err := Decode(context.Background(), tok, nil, nil, GenerateParams{MaxTokens: 5}, (&fixedStepper{ids: ids}).step, nil); err == nil {
		t.Error("empty prompt: no error")
	}
}
