package engine

import (
	"testing"

	"meshgpu/native"
)

// TestGoldenEveryCPUISA runs the CPU golden checks on every matrix-product
// path this machine supports (avx2, and avx512f / avx512bf16 where the CPU
// has them): f32 greedy ids and f32 logits/hidden states against HF, and the
// bf16-activation tie band (the calls that use vdpbf16ps on avx512bf16).
func TestGoldenEveryCPUISA(t *testing.T) {
	t.Cleanup(func() { native.SetCPUISA("") })
	for _, isa := range native.CPUISAs() {
		t.Run(isa, func(t *testing.T) {
			if err := native.SetCPUISA(isa); err != nil {
				t.Fatal(err)
			}
			t.Run("greedy", TestGoldenGreedy)
			t.Run("logits", TestGoldenLogitsAndHidden)
			t.Run("tieband", TestCPUGoldenTieBand)
		})
	}
}
