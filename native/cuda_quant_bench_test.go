package native

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"
	"time"
)

// fastQuant is randQuant for large matrices: random bytes eight at a time,
// then each block's f16 scales set small (the values do not matter to a
// bandwidth measurement; finite ones keep the logits and sampler tame).
func fastQuant(r *rand.Rand, dt DType, rows, cols int) []byte {
	rb, err := dt.RowBytes(cols)
	if err != nil {
		panic(err)
	}
	data := make([]byte, rows*rb+8)
	for i := 0; i+8 <= len(data); i += 8 {
		binary.LittleEndian.PutUint64(data[i:], r.Uint64())
	}
	data = data[:rows*rb]
	be, bb := dt.Block()
	s := toF16(1e-4)
	for b := 0; b < rows*cols/be; b++ {
		blk := data[b*bb:]
		switch dt {
		case Q8_0:
			binary.LittleEndian.PutUint16(blk, s)
		case Q4_K, Q5_K:
			binary.LittleEndian.PutUint16(blk, s)
			binary.LittleEndian.PutUint16(blk[2:], s)
		case Q6_K:
			binary.LittleEndian.PutUint16(blk[208:], s)
		}
	}
	return data
}

// BenchmarkCUDAQuantDecode: whole-model decode (mg_api.decode: embed, 32
// layers in the decode graph, final norm, LM head, device sampler) of the
// Llama-3.1-8B shape with random blocks laid out as llama.cpp's Q4_K_M
// (Q4_K matrices; attn_v and ffn_down Q6_K on half the layers; Q6_K head)
// and Q8_0 files, at batch 1 and 8, against the device-to-device copy
// bandwidth measured in the same run. No GGUF file is needed: the CPU
// quantizer takes ~10 minutes for an 8B file even on 16 cores, and the
// bytes per token, not the values, are what this measures. One layer's
// blocks per (kind, type) are uploaded to every layer (distinct device
// copies, so nothing is read from L2 twice).
func BenchmarkCUDAQuantDecode(b *testing.B) {
	co := cudaOpsOrSkip(b)
	copyGBps, err := co.CopyGBps(2<<30, 20)
	if err != nil {
		b.Fatal(err)
	}
	be, err := Open("cuda", Options{CUDALib: os.Getenv("MESHGPU_CUDA_LIB")})
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	cfg := StackConfig{
		Hidden: 4096, Intermediate: 14336, Heads: 32, KVHeads: 8, HeadDim: 128, Vocab: 128256,
		NumLayers: 32, First: 0, Last: 31, HasEmbed: true, HasHead: true, MaxContext: 512, RMSEps: 1e-5,
		Rope: Rope{Type: RopeLlama3, Theta: 500000, Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OrigMaxPos: 8192},
	}
	files := []struct {
		name  string
		types func(k TensorKind, layer int) DType
	}{
		{"8B-q4_k_m", func(k TensorKind, layer int) DType {
			switch {
			case k == LMHead:
				return Q6_K
			case (k == WV || k == WDown) && layer%2 == 0:
				return Q6_K
			}
			return Q4_K
		}},
		{"8B-q8_0", func(TensorKind, int) DType { return Q8_0 }},
	}
	for _, f := range files {
		b.Run(f.name, func(b *testing.B) {
			r := rand.New(rand.NewPCG(24, 8))
			blocks := map[[2]int][]byte{}
			shapes := map[TensorKind][2]int{
				TokEmbed: {cfg.Vocab, cfg.Hidden}, LMHead: {cfg.Vocab, cfg.Hidden}, WQ: {4096, 4096}, WK: {1024, 4096},
				WV: {1024, 4096}, WO: {4096, 4096}, WGate: {14336, 4096}, WUp: {14336, 4096}, WDown: {4096, 14336},
			}
			ones := make([]byte, 2*cfg.Hidden)
			for i := 0; i < cfg.Hidden; i++ {
				binary.LittleEndian.PutUint16(ones[2*i:], toBF16(1))
			}
			st, err := be.NewStack(cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer st.Close()
			var bytesPerToken int64
			set := func(k TensorKind, layer int, dt DType) {
				sh := shapes[k]
				key := [2]int{int(k), int(dt)}
				if blocks[key] == nil {
					blocks[key] = fastQuant(r, dt, sh[0], sh[1])
				}
				if err := st.SetTensor(Tensor{Kind: k, Layer: layer, DType: dt, Shape: []int{sh[0], sh[1]}, Data: blocks[key]}); err != nil {
					b.Fatal(err)
				}
				if k != TokEmbed {
					bytesPerToken += int64(len(blocks[key]))
				}
			}
			set(TokEmbed, -1, f.types(TokEmbed, -1))
			set(LMHead, -1, f.types(LMHead, -1))
			if err := st.SetTensor(Tensor{Kind: FinalNorm, Layer: -1, DType: BF16, Shape: []int{cfg.Hidden}, Data: ones}); err != nil {
				b.Fatal(err)
			}
			for l := 0; l < cfg.NumLayers; l++ {
				for _, k := range []TensorKind{WQ, WK, WV, WO, WGate, WUp, WDown} {
					set(k, l, f.types(k, l))
				}
				for _, k := range []TensorKind{AttnNorm, MLPNorm} {
					if err := st.SetTensor(Tensor{Kind: k, Layer: l, DType: BF16, Shape: []int{cfg.Hidden}, Data: ones}); err != nil {
						b.Fatal(err)
					}
				}
			}
			if err := st.Ready(); err != nil {
				b.Fatal(err)
			}
			ends, ok := st.(Ends)
			if !ok || !ends.HasEnds() {
				b.Skip("the CUDA library has no decode call")
			}
			for _, batch := range []int{1, 8} {
				sess := make([]Session, batch)
				for i := range sess {
					if sess[i], err = st.NewSession(cfg.MaxContext); err != nil {
						b.Fatal(err)
					}
					defer sess[i].Close()
				}
				steps := make([]TokenStep, batch)
				pos := 0
				step := func(tokens [][]int32) {
					for i := range steps {
						steps[i] = TokenStep{Session: sess[i], Pos: pos, Tokens: tokens[i], GeneratedFrom: pos + len(tokens[i]), Draw: pos}
					}
					ch, err := ends.Decode(steps)
					if err != nil {
						b.Fatal(err)
					}
					pos += len(tokens[0])
					for i := range tokens {
						tokens[i] = []int32{ch[i].ID}
					}
				}
				toks := make([][]int32, batch)
				for i := range toks {
					toks[i] = []int32{1, 2, 3, int32(4 + i)}
				}
				step(toks)
				for i := 0; i < 4; i++ { // captures the decode graph
					step(toks)
				}
				const n = 48
				var per time.Duration
				for it := 0; it < b.N; it++ {
					pos = 0 // a step at 0 truncates the sessions
					step(toks)
					t0 := time.Now()
					for i := 0; i < n; i++ {
						step(toks)
					}
					per = time.Since(t0) / n
				}
				gbps := float64(bytesPerToken) / per.Seconds() / 1e9
				tok := float64(batch) / per.Seconds()
				b.ReportMetric(tok, fmt.Sprintf("b%d-tok/s", batch))
				b.ReportMetric(gbps/copyGBps, fmt.Sprintf("b%d-of-copy", batch))
				fmt.Printf("QUANTBENCH %s b%d %.1f tok/s  %.3f ms/step  %.3f GB/token  %.0f GB/s  of-copy %.3f (copy %.0f GB/s)\n",
					f.name, batch, tok, float64(per.Microseconds())/1e3, float64(bytesPerToken)/1e9, gbps, gbps/copyGBps, copyGBps)
			}
		})
	}
}
