package native

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/model"
	"meshgpu/model/gguf"
)

// quantNMSE quantizes rows x cols of x to dt with model.QuantizeRow and
// returns the NMSE of the CPU backend's dequantization against x.
func quantNMSE(t *testing.T, dt DType, x []float32, rows, cols int) float64 {
	t.Helper()
	rb, _ := dt.RowBytes(cols)
	data := make([]byte, rows*rb)
	for r := 0; r < rows; r++ {
		if err := model.QuantizeRow(gguf.Type(dt), x[r*cols:(r+1)*cols], data[r*rb:(r+1)*rb]); err != nil {
			t.Fatal(err)
		}
	}
	got, err := Dequantize(dt, data, rows, cols)
	if err != nil {
		t.Fatal(err)
	}
	return nmse(got, f64s(x))
}

// TestQuantizerRoundTrip: model.QuantizeRow's blocks, read back by the CPU
// backend, hold gaussian weights within each format's resolution (about
// step^2/12 relative to the variance: Q8_0 ~2e-5, Q6_K ~2e-4, Q5_K ~1e-3,
// Q4_K ~5e-3), and a row with outliers, zeros and a constant keeps its
// zeros exact and its values finite.
func TestQuantizerRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	const rows, cols = 16, 1024
	x := randF32(r, rows*cols, 0.02)
	for dt, bound := range map[DType]float64{Q8_0: 4e-5, Q6_K: 4e-4, Q5_K: 2e-3, Q4_K: 8e-3} {
		e := quantNMSE(t, dt, x, rows, cols)
		t.Logf("%s: NMSE %.3g", dt, e)
		if !(e < bound) {
			t.Errorf("%s: NMSE %.3g, want < %.3g", dt, e, bound)
		}
		odd := make([]float32, 256)
		for i := range odd {
			switch {
			case i < 32: // zeros
			case i < 64:
				odd[i] = 0.5 // a constant
			case i == 100:
				odd[i] = 40 // an outlier
			default:
				odd[i] = float32(r.NormFloat64())
			}
		}
		rb, _ := dt.RowBytes(256)
		data := make([]byte, rb)
		if err := model.QuantizeRow(gguf.Type(dt), odd, data); err != nil {
			t.Fatal(err)
		}
		got, _ := Dequantize(dt, data, 1, 256)
		for i, v := range got {
			if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) || (i < 32 && dt != Q4_K && dt != Q5_K && v != 0) {
				t.Errorf("%s: odd row element %d: %g from %g", dt, i, v, odd[i])
				break
			}
		}
	}
}

// TestQuantizerAgainstLlamaCpp: gocoder-6m's bf16 matrices quantized by
// model.QuantizeRow to the type llama.cpp's files hold them in keep them
// about as well as llama.cpp's quantizer did (NMSE against the bf16 values
// at most 1.1x llama.cpp's; the numbers are logged).
func TestQuantizerAgainstLlamaCpp(t *testing.T) {
	bf, err := gguf.Open(testenv.GoCoderGGUF(t, "bf16"))
	if err != nil {
		t.Fatal(err)
	}
	defer bf.Close()
	for _, file := range []string{"q8_0", "q6_k", "q5_k_m", "q4_k_m"} {
		q, err := gguf.Open(testenv.GoCoderGGUF(t, file))
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range []string{"blk.0.attn_q.weight", "blk.1.ffn_down.weight", "blk.2.ffn_down.weight", "blk.3.ffn_up.weight", "token_embd.weight"} {
			bi, ok1 := bf.Tensor(name)
			qi, ok2 := q.Tensor(name)
			if !ok1 || !ok2 {
				t.Fatalf("%s: no %s", file, name)
			}
			dt := DType(qi.Type)
			shape := bi.Shape()
			bd, _ := bf.Data(bi)
			x := make([]float32, shape[0]*shape[1])
			for i := range x {
				x[i] = math.Float32frombits(uint32(binary.LittleEndian.Uint16(bd[2*i:])) << 16)
			}
			qd, _ := q.Data(qi)
			theirs, err := Dequantize(dt, qd, shape[0], shape[1])
			if err != nil {
				t.Fatal(err)
			}
			eTheirs := nmse(theirs, f64s(x))
			eOurs := quantNMSE(t, dt, x, shape[0], shape[1])
			t.Logf("%s %s (%s): NMSE ours %.4g, llama.cpp %.4g (%.2fx)", file, name, dt, eOurs, eTheirs, eOurs/eTheirs)
			if !(eOurs <= 1.1*eTheirs) {
				t.Errorf("%s %s (%s): NMSE %.4g, llama.cpp's %.4g", file, name, dt, eOurs, eTheirs)
			}
		}
		q.Close()
	}
}
