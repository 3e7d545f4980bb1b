package engine

import (
	"context"
	"slices"
	"strings"
	"testing"
)

// A generation resumed with Resume (the ids an earlier attempt streamed
// before it failed, at the end of the prompt) streams exactly what the
// uninterrupted run streamed after them: bytes of an incomplete character
// or of a possible stop string that the earlier attempt held back come with
// the next token, and a stop string spanning the cut is found. For every cut
// point and several stop sets, the earlier attempt's token chunks plus the
// resumed stream equal the uninterrupted stream.
func TestDecodeResumeContinuesTheStream(t *testing.T) {
	tok := tokenizerOf(t)
	ctx := context.Background()
	text := "x := \"héllo, 世界 😀\"\n// END here\nmore"
	ids := tok.Encode(text, false)
	prompt := []int32{0, 343}
	for _, stops := range [][]string{nil, {"// END"}, {"界 😀\"\n// X", "here"}, {"😀"}} {
		p := GenerateParams{MaxTokens: len(ids), Stop: stops, IgnoreEOS: true}
		var whole strings.Builder
		ref, err := Decode(ctx, tok, nil, prompt, p, (&fixedStepper{ids: ids}).step, func(tk Token) error {
			whole.WriteString(tk.Text)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		for k := 1; k < len(ref.IDs); k++ {
			// The earlier attempt streamed its token chunks for ids[:k] and
			// failed: no final flush.
			var before strings.Builder
			if _, err := Decode(ctx, tok, nil, prompt, GenerateParams{MaxTokens: k, Stop: stops, IgnoreEOS: true},
				(&fixedStepper{ids: ids}).step, func(tk Token) error {
					if tk.ID >= 0 {
						before.WriteString(tk.Text)
					}
					return nil
				}); err != nil {
				t.Fatal(err)
			}
			f := &fixedStepper{ids: ids}
			q := p
			q.MaxTokens, q.Resume = len(ids)-k, ids[:k]
			var after strings.Builder
			res, err := Decode(ctx, tok, nil, append(slices.Clone(prompt), ids[:k]...), q,
				func(ctx context.Context, pos int, tokens []int32, step int) (int32, float32, error) {
					return f.step(ctx, pos, tokens, step+k)
				}, func(tk Token) error {
					after.WriteString(tk.Text)
					return nil
				})
			if err != nil {
				t.Fatal(err)
			}
			if got := before.String() + after.String(); got != whole.String() {
				t.Errorf("stops %q, resumed after %d ids: streamed %q + %q, uninterrupted %q", stops, k, before.String(), after.String(), whole.String())
			}
			if before.String()+res.Text != ref.Text || !slices.Equal(res.IDs, ref.IDs[k:]) || res.FinishReason != ref.FinishReason {
				t.Errorf("stops %q, resumed after %d ids: result %q %v %s; want the rest of %q %v %s", stops, k, res.Text, res.IDs, res.FinishReason, ref.Text, ref.IDs, ref.FinishReason)
			}
		}
	}
}
