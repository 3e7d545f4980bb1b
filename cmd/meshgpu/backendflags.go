package main

import (
	"fmt"

	"github.com/urfave/cli/v2"

	"meshgpu/native"
)

// backendFlags are the backends' kernel settings on every command that
// opens a backend: the CUDA backend's (docs/cuda-settings.md) and the CPU
// backend's matrix-product path. They keep the names the library
// once read from the environment itself (MESHGPU_CUDA_ATTENTION=f32,
// MESHGPU_CUDA_PREFILL_ATTN=tiled, MESHGPU_CUDA_GRAPHS=0); now the CLI
// reads them and hands them to the backend on open.
func backendFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "cuda-attention", Value: "bf16", Usage: "cuda attention numerics: bf16 (PyTorch's math SDPA in bf16, as HF computes) or f32 (flash-style f32 scores and softmax)", EnvVars: envVars("cuda-attention")},
		&cli.StringFlag{Name: "cuda-prefill-attn", Value: "auto", Usage: "cuda prefill attention kernel: auto (cuBLAS while its scratch fits in 1 GiB, else tiled) or tiled", EnvVars: envVars("cuda-prefill-attn")},
		&cli.StringFlag{Name: "cpu-isa", Usage: "cpu matrix-product path: avx2, avx512f or avx512bf16 (default: the fastest this CPU has, measured at start-up where avx512bf16 exists; avx512f or avx2 for bit-exact f32 products)", EnvVars: envVars("cpu-isa")},
		&cli.BoolFlag{Name: "cuda-graphs", Value: true, Usage: "cuda: capture decode steps as CUDA graphs (--cuda-graphs=false runs them kernel by kernel)", EnvVars: envVars("cuda-graphs")},
		&cli.BoolFlag{Name: "cuda-batch-mma", Usage: "cuda: decode matrix-vector products (1-16 rows) on tensor-core tiles instead of the FMA kernels", EnvVars: envVars("cuda-batch-mma")},
		&cli.BoolFlag{Name: "cuda-fused-decode", Usage: "cuda: single-token decode steps do the RoPE and KV-cache append inside attention and run the embedding and LM head inside the decode graph (fewer launches, the same bits)", EnvVars: envVars("cuda-fused-decode")},
	}
}

// backendOptions reads --cuda-lib, --threads and backendFlags.
func backendOptions(c *cli.Context) (native.Options, error) {
	cs, err := cudaSettings(c)
	return native.Options{CUDALib: c.String("cuda-lib"), Threads: c.Int("threads"), CUDA: cs, CPUISA: c.String("cpu-isa")}, err
}

// cudaSettings reads backendFlags.
func cudaSettings(c *cli.Context) (native.CUDASettings, error) {
	var cs native.CUDASettings
	switch v := c.String("cuda-attention"); v {
	case "bf16":
	case "f32":
		cs.AttentionF32 = true
	default:
		return cs, fmt.Errorf("--cuda-attention must be bf16 or f32, not %q", v)
	}
	switch v := c.String("cuda-prefill-attn"); v {
	case "auto":
	case "tiled":
		cs.PrefillTiled = true
	default:
		return cs, fmt.Errorf("--cuda-prefill-attn must be auto or tiled, not %q", v)
	}
	cs.NoGraphs = !c.Bool("cuda-graphs")
	cs.BatchMMA = c.Bool("cuda-batch-mma")
	cs.FusedDecode = c.Bool("cuda-fused-decode")
	return cs, nil
}
