package engine

import (
	"testing"

	"meshgpu/native"
)

// TestGoldenEveryCPUISA runs the CPU golden checks on every matrix-product
// path this machine supports (avx2, and avx512f / avx512bf16 where the CPU
// has them): greedy ids, f32 logits/hidden states against HF on the f32
// paths (avx512bf16 rounds every product's inputs to bf16, as llama.cpp's
// bf16 products do), and the bf16 tie band.
func TestGoldenEveryCPUISA(t *testing.T) {
	t.Cleanup(func() { native.SetCPUISA("") })
	for _, isa := range native.CPUISAs() {
		t.Run(isa, func(t *testing.T) {
			if err := native.SetCPUISA(isa); err != nil {
				t.Fatal(err)
			}
			t.Run("greedy", TestGoldenGreedy)
			if isa != "avx512bf16" {
				t.Run("logits", TestGoldenLogitsAndHidden)
			}
			t.Run("tieband", TestCPUGoldenTieBand)
		})
	}
}
