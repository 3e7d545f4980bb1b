package sample

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestGreedyIsArgmaxWithLogSoftmax(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for trial := 0; trial < 50; trial++ {
		logits := make([]float32, 1000)
		best := 0
		for i := range logits {
			logits[i] = float32(r.NormFloat64() * 3)
			if logits[i] > logits[best] {
				best = i
			}
		}
		// reference log-softmax in float64
		var s float64
		for _, l := range logits {
			s += math.Exp(float64(l))
		}
		want := float64(logits[best]) - math.Log(s)
		id, lp := Sample(append([]float32(nil), logits...), Params{}, nil, trial)
		if int(id) != best {
			t.Fatalf("greedy picked %d, argmax is %d", id, best)
		}
		if math.Abs(float64(lp)-want) > 1e-5 {
			t.Fatalf("greedy logprob %v, want %v", lp, want)
		}
	}
}

func TestRepetitionPenaltyHFSemantics(t *testing.T) {
	// positive logits are divided: 2/2 = 1 < 1.5
	if id, _ := Sample([]float32{2, 1.5}, Params{RepetitionPenalty: 2}, []int32{0, 0}, 0); id != 1 {
		t.Errorf("positive logit not divided: picked %d", id)
	}
	// negative logits are multiplied: -1*2 = -2 < -1.5
	if id, _ := Sample([]float32{-1, -1.5}, Params{RepetitionPenalty: 2}, []int32{0}, 0); id != 1 {
		t.Errorf("negative logit not multiplied: picked %d", id)
	}
	// a token outside the history keeps its logit; ids out of range are ignored
	if id, _ := Sample([]float32{2, 1.5}, Params{RepetitionPenalty: 2}, []int32{1, -5, 99}, 0); id != 0 {
		t.Errorf("penalty applied to a token not in history: picked %d", id)
	}
	// penalty 1 is off
	if id, _ := Sample([]float32{2, 1.5}, Params{RepetitionPenalty: 1}, []int32{0}, 0); id != 0 {
		t.Errorf("penalty 1 changed the pick: %d", id)
	}
}

func TestSeedStepReproducible(t *testing.T) {
	logits := make([]float32, 64)
	for i := range logits {
		logits[i] = float32(math.Sin(float64(i)))
	}
	p := Params{Temperature: 1, Seed: 42}
	seen := map[int32]bool{}
	for step := 0; step < 200; step++ {
		a, la := Sample(append([]float32(nil), logits...), p, nil, step)
		b, lb := Sample(append([]float32(nil), logits...), p, nil, step)
		if a != b || la != lb {
			t.Fatalf("step %d: %d/%v then %d/%v", step, a, la, b, lb)
		}
		seen[a] = true
	}
	if len(seen) < 10 {
		t.Errorf("200 steps drew only %d distinct tokens from a flat-ish distribution", len(seen))
	}
	// different seeds at one step give different draws
	seen = map[int32]bool{}
	for seed := uint64(0); seed < 200; seed++ {
		id, _ := Sample(append([]float32(nil), logits...), Params{Temperature: 1, Seed: seed}, nil, 7)
		seen[id] = true
	}
	if len(seen) < 10 {
		t.Errorf("200 seeds drew only %d distinct tokens", len(seen))
	}
}

// TestFilterFrequencies draws with many seeds from a crafted distribution and
// checks that filters never pick outside the allowed set and that
// frequencies match the renormalized probabilities (within 5 sigma).
func TestFilterFrequencies(t *testing.T) {
	probs := []float64{0.05, 0.4, 0.04, 0.25, 0.15, 0.1, 0.01}
	logits := make([]float32, len(probs))
	for i, q := range probs {
		logits[i] = float32(math.Log(q))
	}
	cases := []struct {
		name    string
		p       Params
		allowed []int // by construction from probs, not from the code under test
	}{
		{"none", Params{Temperature: 1}, []int{0, 1, 2, 3, 4, 5, 6}},
		{"top_k=3", Params{Temperature: 1, TopK: 3}, []int{1, 3, 4}},
		{"top_p=0.7", Params{Temperature: 1, TopP: 0.7}, []int{1, 3, 4}},    // 0.4+0.25 < 0.7
		{"top_p=0.6", Params{Temperature: 1, TopP: 0.6}, []int{1, 3}},       // 0.4 < 0.6 <= 0.65
		{"min_p=0.2", Params{Temperature: 1, MinP: 0.2}, []int{1, 3, 4, 5}}, // >= 0.08
		{"top_k=4,min_p=0.3", Params{Temperature: 1, TopK: 4, MinP: 0.3}, []int{1, 3, 4}},
	}
	const n = 20000
	for _, c := range cases {
		var mass float64
		for _, i := range c.allowed {
			mass += probs[i]
		}
		counts := make([]int, len(probs))
		for seed := 0; seed < n; seed++ {
			p := c.p
			p.Seed = uint64(seed)
			id, lp := Sample(append([]float32(nil), logits...), p, nil, 3)
			counts[id]++
			if want := math.Log(probs[id] / mass); math.Abs(float64(lp)-want) > 1e-4 {
				t.Fatalf("%s: logprob of %d is %v, want %v", c.name, id, lp, want)
			}
		}
		allowed := map[int]bool{}
		for _, i := range c.allowed {
			allowed[i] = true
		}
		for i, k := range counts {
			if !allowed[i] {
				if k > 0 {
					t.Errorf("%s: token %d drawn %d times, not allowed", c.name, i, k)
				}
				continue
			}
			want := probs[i] / mass
			sigma := math.Sqrt(want * (1 - want) / n)
			if got := float64(k) / n; math.Abs(got-want) > 5*sigma+1e-9 {
				t.Errorf("%s: token %d frequency %.4f, want %.4f ± %.4f", c.name, i, got, want, 5*sigma)
			}
		}
	}
}

func TestTemperatureSharpens(t *testing.T) {
	logits := []float32{0, 1}
	count := func(temp float64) int {
		k := 0
		for seed := 0; seed < 4000; seed++ {
			if id, _ := Sample(append([]float32(nil), logits...), Params{Temperature: temp, Seed: uint64(seed)}, nil, 0); id == 1 {
				k++
			}
		}
		return k
	}
	// p(1) = sigmoid(1/T): 0.731 at T=1, 0.881 at T=0.5
	if hot, cold := count(1), count(0.5); !(math.Abs(float64(hot)/4000-0.731) < 0.04 && math.Abs(float64(cold)/4000-0.881) < 0.03) {
		t.Errorf("p(token 1) at T=1: %.3f (want 0.731), at T=0.5: %.3f (want 0.881)", float64(hot)/4000, float64(cold)/4000)
	}
}

func TestValidate(t *testing.T) {
	bad := []Params{
		{Temperature: -1}, {Temperature: math.NaN()}, {TopK: -1}, {TopP: 1.5}, {TopP: -0.1},
		{MinP: 2}, {RepetitionPenalty: -1}, {RepetitionPenalty: math.Inf(1)},
	}
	for _, p := range bad {
		if p.Validate() == nil {
			t.Errorf("%+v: no error", p)
		}
	}
	good := []Params{{}, {Temperature: 0.7, TopK: 40, TopP: 0.9, MinP: 0.05, RepetitionPenalty: 1.1, Seed: 9}}
	for _, p := range good {
		if err := p.Validate(); err != nil {
			t.Errorf("%+v: %v", p, err)
		}
	}
}

func TestExpNeg(t *testing.T) {
	for x := -700.0; x <= 0; x += 0.0137 {
		want := math.Exp(x)
		if got := expNeg(x); math.Abs(got-want) > 1e-11*want {
			t.Fatalf("expNeg(%v) = %v, want %v", x, got, want)
		}
	}
	if expNeg(-1000) != 0 || expNeg(0) != 1 {
		t.Error("expNeg edge cases")
	}
}

// TestTopPCountsTheWholeTail: top_p's mass is a share of the whole
// distribution, including a long tail of tokens far below the most likely
// one. Here 0.4 + 0.2 are the head and 4000 tokens of 0.0001 the tail:
// top_p=0.5 keeps tokens 0 and 1 (0.4 < 0.5 <= 0.6), drawn 2:1.
func TestTopPCountsTheWholeTail(t *testing.T) {
	probs := []float64{0.4, 0.2}
	for len(probs) < 4002 {
		probs = append(probs, 0.0001)
	}
	logits := make([]float32, len(probs))
	for i, q := range probs {
		logits[i] = float32(math.Log(q))
	}
	const n = 3000
	counts := map[int32]int{}
	for seed := 0; seed < n; seed++ {
		id, lp := Sample(append([]float32(nil), logits...), Params{Temperature: 1, TopP: 0.5, Seed: uint64(seed)}, nil, 0)
		counts[id]++
		if id > 1 {
			t.Fatalf("seed %d drew tail token %d", seed, id)
		}
		if want := math.Log(probs[id] / 0.6); math.Abs(float64(lp)-want) > 1e-4 {
			t.Fatalf("logprob of %d is %v, want %v", id, lp, want)
		}
	}
	want := 1.0 / 3
	sigma := math.Sqrt(want * (1 - want) / n)
	if got := float64(counts[1]) / n; math.Abs(got-want) > 5*sigma {
		t.Errorf("token 1 frequency %.4f, want %.4f ± %.4f", got, want, 5*sigma)
	}
}

// TestNonFiniteLogits: logits a numerical blow-up can produce (+Inf, all
// NaN, all -Inf) neither panic nor give a logprob JSON cannot carry; an
// infinite logit is the pick.
func TestNonFiniteLogits(t *testing.T) {
	inf, nan := float32(math.Inf(1)), float32(math.NaN())
	cases := []struct {
		logits []float32
		want   int32 // -1: any id in range
	}{
		{[]float32{1, inf, 2}, 1},
		{[]float32{nan, nan, nan}, -1},
		{[]float32{-inf, -inf}, -1},
		{[]float32{nan, 3, -inf}, 1},
	}
	for _, c := range cases {
		for _, p := range []Params{{}, {Temperature: 1, Seed: 5}, {Temperature: 0.7, TopP: 0.9, TopK: 2, MinP: 0.1, RepetitionPenalty: 1.3}} {
			id, lp := Sample(append([]float32(nil), c.logits...), p, []int32{0}, 3)
			if id < 0 || int(id) >= len(c.logits) || (c.want >= 0 && id != c.want) {
				t.Errorf("%v %+v: picked %d, want %d", c.logits, p, id, c.want)
			}
			if math.IsNaN(float64(lp)) || math.IsInf(float64(lp), 0) || lp > 0 {
				t.Errorf("%v %+v: logprob %v", c.logits, p, lp)
			}
		}
	}
}
