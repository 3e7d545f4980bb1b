package native

/*
#include <stdlib.h>
#include "cpu_kernels.h"
*/
import "C"

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"
)

// The CPU backend's matrix-product paths, oldest first. "avx512bf16"
// rounds the inputs of bf16 weights' products to bf16 (vdpbf16ps) at every
// step, decode and prefill alike, as llama.cpp does; the others multiply
// in f32 ("avx512f" is the bit-exact f32
// path on an AVX-512 CPU). The default is the newest the CPU has, except
// that avx512bf16 is the default only where its tile measured clearly
// faster than avx512f's when the process started (CPUBF16Speedup: 1.5x
// or more), or on an AMD CPU where the measurement is not clear either way
// (over 0.9x and under 1.5x; cpu_isa.c).
// Options.CPUISA (meshgpu's --cpu-isa) picks one when a backend opens.
var cpuISAs = []string{"scalar", "avx2", "avx512f", "avx512bf16"}

// PromptStepMin is the fewest tokens of a forward step (a prompt, not a
// decode step or a verify pass) that takes the CPU backend's prompt
// products: for quantized weights on AVX-512 f32 products on dequantized
// rows, or 16-bit VNNI products where those measured clearly faster, by
// the bf16 default's banded rule (CPUPromptQ16) (cpu_backend.c step_path).
const PromptStepMin = C.MG_PROMPT_STEP_MIN

// CPUISA is the path the CPU backend's matrix products use now.
func CPUISA() string { return C.GoString(C.mg_cpu_isa_name(C.mg_cpu_isa())) }

// CPUISADefault is the path used when none is named.
func CPUISADefault() string { return C.GoString(C.mg_cpu_isa_name(C.mg_cpu_isa_default())) }

// CPUISAF32 is the path the golden tests name for f32 products of bf16
// weights at every step length: the default, or avx512f where the default
// is avx512bf16.
func CPUISAF32() string {
	if d := CPUISADefault(); d != "avx512bf16" {
		return d
	}
	return "avx512f"
}

// F32Products switches the CPU backend to f32 products (CPUISAF32) where
// the current path is avx512bf16, for a computation that needs them (an f32
// reference: the golden figures, a perplexity --kl-base); restore switches
// back. The path is the process's, so nothing else may run meanwhile.
func F32Products() (restore func(), err error) {
	cur := CPUISA()
	if cur != "avx512bf16" {
		return func() {}, nil
	}
	if err := SetCPUISA(CPUISAF32()); err != nil {
		return nil, err
	}
	return func() { SetCPUISA(cur) }, nil
}

// CPUBF16Speedup is how many times faster the avx512bf16 register tile ran
// than avx512f's in the measurement that chose the default (0 where
// avx512bf16 is not supported).
func CPUBF16Speedup() float64 { return float64(C.mg_cpu_bf16_speedup()) }

// CPUISAs lists the paths this CPU, its OS and this build support, oldest first.
func CPUISAs() []string {
	var out []string
	for i, name := range cpuISAs {
		if C.mg_cpu_isa_supported(C.int(i)) != 0 {
			out = append(out, name)
		}
	}
	return out
}

// SetCPUISA switches every CPU backend in the process to the named path
// ("" restores the default). Call it while no forward pass runs: Open does,
// for Options.CPUISA, before the backend exists; tests and benchmarks do
// between runs.
func SetCPUISA(name string) error {
	if name == "" {
		C.mg_cpu_set_isa(-1)
		return nil
	}
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	i := C.mg_cpu_isa_parse(cs)
	if i < 0 {
		return fmt.Errorf("cpu isa %q: want one of %s", name, strings.Join(cpuISAs, ", "))
	}
	if C.mg_cpu_set_isa(i) != 0 {
		return fmt.Errorf("cpu isa %q: not supported here (supported: %s)", name, strings.Join(CPUISAs(), ", "))
	}
	return nil
}

// CPUQuantAct is the width (8 or 16 bits) of the activations in the CPU
// backend's products of quantized weights now.
func CPUQuantAct() int { return int(C.mg_cpu_quant_act()) }

// SetCPUQuantAct switches every CPU backend in the process to 8-bit
// (cpu_quant8.c) or 16-bit (cpu_quant.c) activations for quantized
// weights; 0 restores the default (16 bits; cpu_isa.c says why). Call it
// while no forward pass runs.
func SetCPUQuantAct(bits int) error {
	if C.mg_cpu_set_quant_act(C.int(bits)) != 0 {
		return fmt.Errorf("cpu quantized activations %d: want 8 or 16", bits)
	}
	return nil
}

// applyCPUQuantAct applies Options.CPUQuantAct, else $MESHGPU_CPU_QUANT_ACT
// (so every command that opens a backend takes it), else leaves the width.
func applyCPUQuantAct(bits int) error {
	if bits == 0 {
		env := os.Getenv("MESHGPU_CPU_QUANT_ACT")
		if env == "" {
			return nil
		}
		v, err := strconv.Atoi(env)
		if err != nil {
			return fmt.Errorf("MESHGPU_CPU_QUANT_ACT=%q: want 8 or 16", env)
		}
		bits = v
	}
	return SetCPUQuantAct(bits)
}
