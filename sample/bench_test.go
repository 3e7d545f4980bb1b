package sample

import (
	"math"
	"math/rand/v2"
	"testing"
)

// Sampling runs on the head node once per token; these show its cost at a
// Llama 3 vocabulary next to a plain argmax over the same logits (the floor).
func benchLogits() []float32 {
	r := rand.New(rand.NewPCG(3, 4))
	l := make([]float32, 128256)
	for i := range l {
		l[i] = float32(r.NormFloat64() * 4)
	}
	return l
}

func benchSample(b *testing.B, p Params) {
	src := benchLogits()
	work := make([]float32, len(src))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		copy(work, src)
		Sample(work, p, nil, i)
	}
}

func BenchmarkArgmaxFloor(b *testing.B) {
	src := benchLogits()
	work := make([]float32, len(src))
	for i := 0; i < b.N; i++ {
		copy(work, src)
		argmax(work)
	}
}
func BenchmarkGreedy128k(b *testing.B)      { benchSample(b, Params{}) }
func BenchmarkTemperature128k(b *testing.B) { benchSample(b, Params{Temperature: 0.8}) }
func BenchmarkTopP128k(b *testing.B)        { benchSample(b, Params{Temperature: 0.8, TopP: 0.9}) }
func BenchmarkTopK128k(b *testing.B)        { benchSample(b, Params{Temperature: 0.8, TopK: 40}) }

func BenchmarkExpNeg(b *testing.B) {
	s := 0.0
	for i := 0; i < b.N; i++ {
		s += expNeg(-float64(i&1023) * 0.01)
	}
	_ = s
}

func BenchmarkMathExp(b *testing.B) {
	s := 0.0
	for i := 0; i < b.N; i++ {
		s += math.Exp(-float64(i&1023) * 0.01)
	}
	_ = s
}
