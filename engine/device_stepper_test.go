package engine

import (
	"context"
	"slices"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/native"
	"meshgpu/sample"
)

// TestDeviceStepperMatchesLocal generates on gocoder-6m through the
// backend's single-node call (embed, layers, head and the C sampler in one
// call, the history kept native-side) and through the separate calls with
// Go's sampler: the same ids and logprobs, greedy and sampled with every
// penalty.
func TestDeviceStepperMatchesLocal(t *testing.T) {
	dir := testenv.GoCoder(t)
	g := loadGolden(t, dir)
	m := loadModel(t, dir, openCPU(t), 0, -1)
	prompt := g.Generations[1].PromptIDs
	for _, sp := range []sample.Params{{},
		{Temperature: 0.8, TopK: 40, TopP: 0.9, MinP: 0.02, RepetitionPenalty: 1.1, PresencePenalty: 0.6, FrequencyPenalty: 0.4, Seed: 5}} {
		p := GenerateParams{MaxTokens: 24, IgnoreEOS: true, Sampling: sp}
		run := func(device bool) (ids []int32, lps []float32) {
			sess, err := m.Stack.NewSession(len(prompt) + p.MaxTokens)
			if err != nil {
				t.Fatal(err)
			}
			defer sess.Close()
			step := m.LocalStepper(sess, sp, native.F32)
			if device {
				var ok bool
				if step, ok = m.DeviceStepper(sess, sp); !ok {
					t.Fatal("the CPU stack has no single-node call")
				}
			}
			res, err := Decode(context.Background(), m.Tokenizer, m.EOS(), prompt, p, step, func(tk Token) error {
				if tk.ID >= 0 {
					lps = append(lps, tk.Logprob)
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			return res.IDs, lps
		}
		li, ll := run(false)
		di, dl := run(true)
		if !slices.Equal(li, di) || !slices.Equal(ll, dl) {
			t.Errorf("%+v:\n local  %v %v\n device %v %v", sp, li, ll, di, dl)
		}
	}
}
