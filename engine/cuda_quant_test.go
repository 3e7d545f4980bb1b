package engine

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/native"
)

// TestCUDAQuantGreedyMatchesCPU: gocoder-6m's Q4_K_M GGUF (llama.cpp's
// blocks: Q4_K, Q6_K attn_v and half the ffn_down, a Q6_K embedding tied to
// the head) on CUDA against the CPU backend on the same file, per golden
// prompt:
//   - teacher-forced along the CPU's 64 greedy ids, the CPU's next token is
//     CUDA's top-1 or within goldenTieULPs bf16 ulps of CUDA's top logit at
//     every step (TestCUDAGoldenGreedy's tie band);
//   - free-running CUDA greedy ids follow the CPU's up to the first step
//     where that check found a tie (the same prefix, so the same
//     computation), or all 64.
//
// Both compute the same blocks; they differ in numerics only: the CPU keeps
// activations f32 and rounds them to 16 bits per 32 inside its products,
// CUDA keeps a bf16 residual stream and rounds decode activations to int8
// per 32 (ggml-cuda's scheme).
func TestCUDAQuantGreedyMatchesCPU(t *testing.T) {
	be := openCUDAOrSkip(t)
	g := loadGolden(t, testenv.GoCoder(t))
	path := testenv.GoCoderGGUF(t, "q4_k_m")
	cu := loadModel(t, path, be, 0, -1)
	cpu := loadModel(t, path, openCPU(t), 0, -1)
	p := GenerateParams{MaxTokens: 64, IgnoreEOS: true}
	for i, gen := range g.Generations {
		want, err := cpu.Generate(context.Background(), gen.PromptIDs, p, nil)
		if err != nil {
			t.Fatal(err)
		}
		got, err := cu.Generate(context.Background(), gen.PromptIDs, p, nil)
		if err != nil {
			t.Fatal(err)
		}
		forced := teacherForced(t, cu, gen.PromptIDs, want.IDs)
		worst, missed := 0.0, 0
		for step, f := range forced {
			worst = max(worst, f.gapULPs)
			if f.top == want.IDs[step] {
				continue
			}
			missed++
			fmt.Printf("QUANT prompt %d step %d (teacher-forced): cuda top-1 %d, cpu's %d is %.1f bf16 ulps lower\n",
				i, step, f.top, want.IDs[step], f.gapULPs)
			if f.gapULPs > goldenTieULPs {
				t.Errorf("prompt %d step %d: the cpu's token %d is %.1f bf16 ulps below cuda's top-1 %d, want <= %d",
					i, step, want.IDs[step], f.gapULPs, f.top, goldenTieULPs)
			}
		}
		match := commonPrefix(got.IDs, want.IDs)
		fmt.Printf("QUANT prompt %d: q4_k_m cuda greedy == cpu for %d of %d tokens; teacher-forced, cpu's token is cuda's top-1 at %d of %d steps (worst gap %.1f ulps)\n",
			i, match, len(want.IDs), len(want.IDs)-missed, len(want.IDs), worst)
		if match < len(want.IDs) && match < len(forced) && forced[match].gapULPs > goldenTieULPs {
			t.Errorf("prompt %d: cuda parts from the cpu at token %d, not at a tie\n got %v\nwant %v", i, match, got.IDs, want.IDs)
		}
	}
}

// TestCUDAQuantSplit: the Q4_K_M file as layers 0-2 and 3-5 on two CUDA
// stacks with a bf16 hop gives exactly one stack's ids (the hop wire is
// unchanged; the residual stream is bf16 on CUDA, so the hop loses nothing).
func TestCUDAQuantSplit(t *testing.T) {
	be := openCUDAOrSkip(t)
	g := loadGolden(t, testenv.GoCoder(t))
	path := testenv.GoCoderGGUF(t, "q4_k_m")
	whole := loadModel(t, path, be, 0, -1)
	a := loadModel(t, path, be, 0, 2)
	b := loadModel(t, path, be, 3, -1)
	p := GenerateParams{MaxTokens: 64, IgnoreEOS: true}
	for i, gen := range g.Generations {
		one, err := whole.Generate(context.Background(), gen.PromptIDs, p, nil)
		if err != nil {
			t.Fatal(err)
		}
		split, err := Decode(context.Background(), whole.Tokenizer, whole.EOS(), gen.PromptIDs, p,
			newChain(t, []*Model{a, b}, native.BF16).Stepper(p.Sampling), nil)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Printf("QUANT split prompt %d: layers 0-2 + 3-5 (bf16 hop) == one stack for %d of %d tokens\n",
			i, commonPrefix(split.IDs, one.IDs), len(one.IDs))
		if !slices.Equal(split.IDs, one.IDs) {
			t.Errorf("prompt %d: split\n got %v\nwant %v", i, split.IDs, one.IDs)
		}
	}
}
