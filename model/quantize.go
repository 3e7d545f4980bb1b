package model

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"strings"

	"meshgpu/model/gguf"

	"golang.org/x/sync/errgroup"
)

// Quantization: ggml's block formats (the CPU backend's cpu_quant.c reads
// them; meshgpu.h describes each block), written from f32 values.
//
//   - Q8_0: per 32 weights d = max|x| / 127, q = round(x / d).
//   - Q4_K, Q5_K: per 32 weights a scale s and an offset -m (m >= 0),
//     w = s*q - m with q in 0..15 (0..31), found by a small search: for 21
//     candidate steps (nmax - 1 + 0.1 i) / (max - min) the weights are
//     rounded, then s and m refitted by weighted least squares (weights
//     rms(x) + |x|, as ggml weighs them), keeping the fit of least weighted
//     error. The 8 scales and 8 mins of a 256-weight block are then rounded
//     to 6 bits against the block's f16 d = max s / 63, dmin = max m / 63,
//     and every q recomputed from the rounded scale and min.
//   - Q6_K: per 16 weights a signed scale with q in -32..31, the one of 19
//     candidates around -32 / x_maxabs of least error (weights x^2,
//     least-squares refit), then the 16 scales rounded to int8 against
//     d = -max_scale / 128, and q recomputed.
//
// The file types follow llama.cpp's rules: q8_0 and q6_k quantize every
// matrix to that type; q4_k_m (q5_k_m) uses Q4_K (Q5_K) except Q6_K for the
// output (the token embedding when tied) and for attn_v and ffn_down in
// the layers where llama.cpp's use_more_bits holds (the first and last
// eighth of the layers and every third between: half of them). A matrix
// whose rows are not whole blocks falls back to Q8_0 (rows of 32), else
// stays as it is; vectors (norms, rope_freqs) stay as they are.

// QuantizeSchemes are the file types QuantizeGGUF writes.
var QuantizeSchemes = []string{"q8_0", "q6_k", "q5_k_m", "q4_k_m"}

var schemeFileType = map[string]uint32{"q8_0": 7, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}

// QuantizeRow writes the blocks of x (a whole number of t's blocks) to
// dst (exactly x's bytes in t). t is Q8_0, Q4_K, Q5_K or Q6_K.
func QuantizeRow(t gguf.Type, x []float32, dst []byte) error {
	rb, err := t.RowBytes(uint64(len(x)))
	if err != nil {
		return err
	}
	if uint64(len(dst)) != rb {
		return fmt.Errorf("quantize: %d bytes for a row of %d bytes", len(dst), rb)
	}
	switch t {
	case gguf.Q8_0:
		for b := 0; b < len(x)/32; b++ {
			quantQ8_0(x[32*b:32*b+32], dst[34*b:34*b+34])
		}
	case gguf.Q4_K, gguf.Q5_K:
		bb := 144
		if t == gguf.Q5_K {
			bb = 176
		}
		for b := 0; b < len(x)/256; b++ {
			quantK45(x[256*b:256*b+256], dst[bb*b:bb*b+bb], t == gguf.Q5_K)
		}
	case gguf.Q6_K:
		for b := 0; b < len(x)/256; b++ {
			quantQ6K(x[256*b:256*b+256], dst[210*b:210*b+210])
		}
	default:
		return fmt.Errorf("quantize: type %s is not one of Q8_0, Q4_K, Q5_K, Q6_K", t)
	}
	return nil
}

// f16Bits rounds f to the nearest f16, ties to even.
func f16Bits(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	e := int(b>>23) & 0xff
	man := b & 0x7fffff
	if e == 0xff {
		if man != 0 {
			return sign | 0x7e00
		}
		return sign | 0x7c00
	}
	a := math.Abs(float64(f))
	if a < 1.0/16384 { // below the smallest normal: multiples of 2^-24
		return sign | uint16(math.RoundToEven(a*(1<<24)))
	}
	exp := e - 127 + 15
	m := man >> 13
	rem := man & 0x1fff
	if rem > 0x1000 || (rem == 0x1000 && m&1 == 1) {
		m++
		if m == 0x400 {
			m = 0
			exp++
		}
	}
	if exp >= 31 {
		return sign | 0x7c00
	}
	return sign | uint16(exp)<<10 | uint16(m)
}

func f16Value(h uint16) float32 {
	sign := float32(1)
	if h&0x8000 != 0 {
		sign = -1
	}
	e, m := int(h>>10)&0x1f, float64(h&0x3ff)
	switch e {
	case 0:
		return sign * float32(m*math.Pow(2, -24))
	case 31:
		if m != 0 {
			return float32(math.NaN())
		}
		return sign * float32(math.Inf(1))
	}
	return sign * float32((1+m/1024)*math.Pow(2, float64(e-15)))
}

func clampRound(v float64, lo, hi int) int {
	q := int(math.Round(v))
	if q < lo {
		return lo
	}
	if q > hi {
		return hi
	}
	return q
}

func quantQ8_0(x []float32, dst []byte) {
	var amax float64
	for _, v := range x {
		amax = math.Max(amax, math.Abs(float64(v)))
	}
	d := amax / 127
	binary.LittleEndian.PutUint16(dst, f16Bits(float32(d)))
	for i, v := range x {
		q := 0
		if d > 0 {
			q = clampRound(float64(v)/d, -127, 127)
		}
		dst[2+i] = byte(int8(q))
	}
}

// fitScaleMin fits x ~ s*q - m, q in 0..nmax, m >= 0 (see the top).
func fitScaleMin(x []float32, w []float64, nmax int) (s, m float64) {
	lo, hi := 0.0, math.Inf(-1)
	for _, v := range x {
		lo = math.Min(lo, float64(v))
		hi = math.Max(hi, float64(v))
	}
	if hi <= lo {
		return 0, -lo
	}
	bestErr := math.Inf(1)
	s, m = (hi-lo)/float64(nmax), -lo
	var q [32]int
	for step := 0; step <= 20; step++ {
		iscale := (float64(nmax) - 1 + 0.1*float64(step)) / (hi - lo)
		var sw, sq, sqq, sx, sqx float64
		for i, v := range x {
			q[i] = clampRound(iscale*(float64(v)-lo), 0, nmax)
			qq := float64(q[i])
			sw += w[i]
			sq += w[i] * qq
			sqq += w[i] * qq * qq
			sx += w[i] * float64(v)
			sqx += w[i] * qq * float64(v)
		}
		det := sw*sqq - sq*sq
		if det <= 0 {
			continue
		}
		cs, cb := (sw*sqx-sq*sx)/det, (sqq*sx-sq*sqx)/det
		if cb > 0 { // the offset must be <= 0
			cb, cs = 0, sqx/sqq
		}
		if cs <= 0 {
			continue
		}
		var e float64
		for i, v := range x {
			d := cs*float64(q[i]) + cb - float64(v)
			e += w[i] * d * d
		}
		if e < bestErr {
			bestErr, s, m = e, cs, -cb
		}
	}
	return s, m
}

func quantK45(x []float32, dst []byte, q5 bool) {
	nmax := 15
	if q5 {
		nmax = 31
	}
	var ss float64
	for _, v := range x {
		ss += float64(v) * float64(v)
	}
	av := math.Sqrt(ss / 256)
	var wb [32]float64
	w := wb[:]
	var scales, mins [8]float64
	var maxS, maxM float64
	for j := 0; j < 8; j++ {
		sub := x[32*j : 32*j+32]
		for i, v := range sub {
			w[i] = av + math.Abs(float64(v))
		}
		scales[j], mins[j] = fitScaleMin(sub, w, nmax)
		maxS, maxM = math.Max(maxS, scales[j]), math.Max(maxM, mins[j])
	}
	var ls, lm [8]int
	for j := 0; j < 8; j++ {
		if maxS > 0 {
			ls[j] = clampRound(63/maxS*scales[j], 0, 63)
		}
		if maxM > 0 {
			lm[j] = clampRound(63/maxM*mins[j], 0, 63)
		}
	}
	dh, mh := f16Bits(float32(maxS/63)), f16Bits(float32(maxM/63))
	binary.LittleEndian.PutUint16(dst, dh)
	binary.LittleEndian.PutUint16(dst[2:], mh)
	s12 := dst[4:16]
	for i := range s12 {
		s12[i] = 0
	}
	for j := 0; j < 8; j++ {
		if j < 4 {
			s12[j] = byte(ls[j])
			s12[j+4] = byte(lm[j])
		} else {
			s12[j+4] = byte(ls[j]&0xF) | byte(lm[j]&0xF)<<4
			s12[j-4] |= byte(ls[j]>>4) << 6
			s12[j] |= byte(lm[j]>>4) << 6
		}
	}
	d, dmin := float64(f16Value(dh)), float64(f16Value(mh))
	var q [256]int
	for j := 0; j < 8; j++ {
		dl, ml := float64(float32(d*float64(ls[j]))), float64(float32(dmin*float64(lm[j])))
		for i := 0; i < 32; i++ {
			if dl > 0 {
				q[32*j+i] = clampRound((float64(x[32*j+i])+ml)/dl, 0, nmax)
			}
		}
	}
	qs := dst[16:]
	if q5 {
		qh := dst[16:48]
		for i := range qh {
			qh[i] = 0
		}
		qs = dst[48:]
		for j := 0; j < 4; j++ {
			for l := 0; l < 32; l++ {
				qh[l] |= byte(q[64*j+l]>>4) << (2 * j)
				qh[l] |= byte(q[64*j+32+l]>>4) << (2*j + 1)
			}
		}
	}
	for j := 0; j < 4; j++ {
		for l := 0; l < 32; l++ {
			qs[32*j+l] = byte(q[64*j+l]&0xF) | byte(q[64*j+32+l]&0xF)<<4
		}
	}
}

// fitSymmetric fits x ~ s*q, q in -32..31 (see the top).
func fitSymmetric(x []float32) float64 {
	var amax, v0 float64
	for _, v := range x {
		if a := math.Abs(float64(v)); a > amax {
			amax, v0 = a, float64(v)
		}
	}
	if amax == 0 {
		return 0
	}
	best, bestErr := -v0/32, math.Inf(1)
	for k := -9; k <= 9; k++ {
		iscale := -(32 + 0.1*float64(k)) / v0
		var sxq, sqq float64
		var q [16]int
		for i, v := range x {
			q[i] = clampRound(iscale*float64(v), -32, 31)
			w := float64(v) * float64(v)
			sxq += w * float64(v) * float64(q[i])
			sqq += w * float64(q[i]) * float64(q[i])
		}
		if sqq == 0 {
			continue
		}
		s := sxq / sqq
		var e float64
		for i, v := range x {
			d := s*float64(q[i]) - float64(v)
			e += float64(v) * float64(v) * d * d
		}
		if e < bestErr {
			best, bestErr = s, e
		}
	}
	return best
}

func quantQ6K(x []float32, dst []byte) {
	var scales [16]float64
	var maxAbs, maxScale float64
	for j := 0; j < 16; j++ {
		scales[j] = fitSymmetric(x[16*j : 16*j+16])
		if a := math.Abs(scales[j]); a > maxAbs {
			maxAbs, maxScale = a, scales[j]
		}
	}
	var sc [16]int
	dh := uint16(0)
	if maxAbs > 0 {
		iscale := -128 / maxScale
		for j := range sc {
			sc[j] = clampRound(iscale*scales[j], -128, 127)
		}
		dh = f16Bits(float32(1 / iscale))
	}
	d := float64(f16Value(dh))
	var q [256]int
	for j := 0; j < 16; j++ {
		dl := float64(float32(d * float64(sc[j])))
		for i := 0; i < 16; i++ {
			if dl != 0 {
				q[16*j+i] = clampRound(float64(x[16*j+i])/dl, -32, 31)
			}
			q[16*j+i] += 32
		}
	}
	ql, qh := dst[:128], dst[128:192]
	for i := range qh {
		qh[i] = 0
	}
	for h := 0; h < 2; h++ {
		for l := 0; l < 32; l++ {
			y := q[128*h:]
			ql[64*h+l] = byte(y[l]&0xF) | byte(y[l+64]&0xF)<<4
			ql[64*h+32+l] = byte(y[l+32]&0xF) | byte(y[l+96]&0xF)<<4
			qh[32*h+l] = byte(y[l]>>4) | byte(y[l+32]>>4)<<2 | byte(y[l+64]>>4)<<4 | byte(y[l+96]>>4)<<6
		}
	}
	for j := 0; j < 16; j++ {
		dst[192+j] = byte(int8(sc[j]))
	}
	binary.LittleEndian.PutUint16(dst[208:], dh)
}

// useMoreBits is llama.cpp's rule for which layers' attn_v and ffn_down
// get Q6_K in its _M file types.
func useMoreBits(layer, layers int) bool {
	return layer < layers/8 || layer >= 7*layers/8 || (layer-layers/8)%3 == 2
}

// quantType is the type scheme gives GGUF tensor t of a model of layers
// layers (tied: no output.weight).
func quantType(scheme string, t gguf.TensorInfo, layers int, tied bool) gguf.Type {
	if len(t.Dims) != 2 || !(t.Type == gguf.F32 || t.Type == gguf.F16 || t.Type == gguf.BF16) {
		return t.Type
	}
	var want gguf.Type
	switch scheme {
	case "q8_0":
		want = gguf.Q8_0
	case "q6_k":
		want = gguf.Q6_K
	default:
		want = gguf.Q4_K
		if scheme == "q5_k_m" {
			want = gguf.Q5_K
		}
		layer := -1
		var suffix string
		if rest, ok := strings.CutPrefix(t.Name, "blk."); ok {
			if num, s, ok := strings.Cut(rest, "."); ok {
				fmt.Sscan(num, &layer)
				suffix = s
			}
		}
		switch {
		case t.Name == "output.weight" || (tied && t.Name == "token_embd.weight"):
			want = gguf.Q6_K
		case (suffix == "attn_v.weight" || suffix == "ffn_down.weight") && layer >= 0 && useMoreBits(layer, layers):
			want = gguf.Q6_K
		}
	}
	if _, err := want.RowBytes(t.Dims[0]); err == nil {
		return want
	}
	if t.Dims[0]%32 == 0 {
		return gguf.Q8_0
	}
	return t.Type
}

// QuantizeGGUF writes the GGUF file in (float matrices: F32, F16 or BF16)
// as out with its matrices quantized by scheme (QuantizeSchemes); the
// metadata is kept, general.file_type set. progress, when set, gets the
// bytes read so far and the total.
func QuantizeGGUF(ctx context.Context, in, out, scheme string, force bool, progress func(done, total int64)) error {
	if _, ok := schemeFileType[scheme]; !ok {
		return fmt.Errorf("quantize: type %q: want one of %s", scheme, strings.Join(QuantizeSchemes, ", "))
	}
	src, err := gguf.Open(in)
	if err != nil {
		return err
	}
	defer src.Close()
	if _, err := os.Stat(out); err == nil && !force {
		return fmt.Errorf("%s already exists; choose another path or force overwriting (--force)", out)
	}
	layers := 0
	tied := true
	for _, t := range src.Tensors {
		if t.Name == "output.weight" {
			tied = false
		}
		if rest, ok := strings.CutPrefix(t.Name, "blk."); ok {
			var l int
			if _, err := fmt.Sscan(strings.SplitN(rest, ".", 2)[0], &l); err == nil && l+1 > layers {
				layers = l + 1
			}
		}
		if len(t.Dims) == 2 && !(t.Type == gguf.F32 || t.Type == gguf.F16 || t.Type == gguf.BF16) {
			return fmt.Errorf("%s: tensor %s is already %s; quantize a file of float matrices (F32, F16, BF16)", in, t.Name, t.Type)
		}
	}
	ts := make([]gguf.WriteTensor, len(src.Tensors))
	var total int64
	for i, t := range src.Tensors {
		ts[i] = gguf.WriteTensor{Name: t.Name, Dims: t.Dims, Type: quantType(scheme, t, layers, tied)}
		total += int64(t.Size)
	}
	var kv []gguf.KV
	for _, e := range src.KV {
		if e.Key != "general.file_type" && e.Key != "general.quantization_version" {
			kv = append(kv, e)
		}
	}
	kv = append(kv, gguf.KV{Key: "general.file_type", Value: gguf.Uint32(schemeFileType[scheme])},
		gguf.KV{Key: "general.quantization_version", Value: gguf.Uint32(2)})
	tmp := out + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	var done int64
	if progress != nil {
		progress(0, total)
	}
	_, err = gguf.Write(f, kv, ts, func(i int, w io.Writer) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		t := src.Tensors[i]
		data, _ := src.Data(t)
		if ts[i].Type == t.Type {
			_, err := w.Write(data)
			done += int64(t.Size)
			if progress != nil {
				progress(done, total)
			}
			return err
		}
		q, err := quantizeTensor(t, ts[i].Type, data)
		if err != nil {
			return err
		}
		_, err = w.Write(q)
		done += int64(t.Size)
		if progress != nil {
			progress(done, total)
		}
		return err
	})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("quantize %s: %w", in, err)
	}
	return os.Rename(tmp, out)
}

// quantizeTensor quantizes a float matrix's rows to t, rows split among
// the CPUs.
func quantizeTensor(info gguf.TensorInfo, t gguf.Type, data []byte) ([]byte, error) {
	cols, rows := int(info.Dims[0]), int(info.Dims[1])
	rb, err := t.RowBytes(uint64(cols))
	if err != nil {
		return nil, err
	}
	out := make([]byte, rows*int(rb))
	workers := runtime.GOMAXPROCS(0)
	var g errgroup.Group
	for wkr := 0; wkr < workers; wkr++ {
		g.Go(func() error {
			x := make([]float32, cols)
			for r := wkr; r < rows; r += workers {
				for c := 0; c < cols; c++ {
					switch info.Type {
					case gguf.F32:
						x[c] = math.Float32frombits(binary.LittleEndian.Uint32(data[4*(r*cols+c):]))
					case gguf.F16:
						x[c] = f16Value(binary.LittleEndian.Uint16(data[2*(r*cols+c):]))
					default:
						x[c] = math.Float32frombits(uint32(binary.LittleEndian.Uint16(data[2*(r*cols+c):])) << 16)
					}
				}
				if err := QuantizeRow(t, x, out[r*int(rb):(r+1)*int(rb)]); err != nil {
					return err
				}
			}
			return nil
		})
	}
	return out, g.Wait()
}
