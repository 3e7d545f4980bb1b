package sample

import (
	"math"
	"math/rand/v2"
	"testing"
)

// chiSquareCritical is the chi-square quantile of dof degrees of freedom
// with upper tail alpha 1e-3 (Wilson-Hilferty; z = 3.0902).
func chiSquareCritical(dof int) float64 {
	k := float64(dof)
	c := 1 - 2/(9*k) + 3.0902*math.Sqrt(2/(9*k))
	return k * c * c * c
}

// softmaxT is the sampler's distribution at temperature t (no filters).
func softmaxT(logits []float32, t float64) []float64 {
	p := make([]float64, len(logits))
	mx := math.Inf(-1)
	for _, l := range logits {
		mx = math.Max(mx, float64(l)/t)
	}
	var s float64
	for i, l := range logits {
		p[i] = math.Exp(float64(l)/t - mx)
		s += p[i]
	}
	for i := range p {
		p[i] /= s
	}
	return p
}

// chiSquare of observed counts against expected probabilities.
func chiSquare(obs []int, p []float64, n int) float64 {
	var x float64
	for i, o := range obs {
		e := p[i] * float64(n)
		x += (float64(o) - e) * (float64(o) - e) / e
	}
	return x
}

// Speculative sampling keeps the target distribution: over 4000 seeds, with
// one-hot drafts chosen at random (the likeliest token, the rarest, any),
// the first token Verify answers has p's frequencies (chi-square, false
// alarm 1e-3; the seeds are fixed, so the test cannot flake), each draft is
// accepted with probability p(draft), and the frequencies agree with plain
// decoding's on other seeds (two-sample chi-square). A verifier that always
// accepts the draft fails the same test.
func TestVerifyKeepsTheDistribution(t *testing.T) {
	const vocab, n = 8, 4000
	rng := rand.New(rand.NewPCG(7, 11))
	logits := make([]float32, vocab)
	for i := range logits {
		logits[i] = float32(rng.NormFloat64() * 1.5)
	}
	next := make([]float32, vocab)
	for i := range next {
		next[i] = float32(rng.NormFloat64())
	}
	par := Params{Temperature: 0.8}
	p := softmaxT(logits, par.Temperature)
	rows := func(i int) []float32 {
		r := logits
		if i > 0 {
			r = next
		}
		return append([]float32(nil), r...) // Sample may modify its logits
	}
	spec := make([]int, vocab)
	naive := make([]int, vocab)
	plain := make([]int, vocab)
	proposed := make([]int, vocab)
	accepted := make([]int, vocab)
	for s := 0; s < n; s++ {
		x := int32(rng.IntN(vocab))
		par.Seed = uint64(s + 1)
		out := Verify(rows, []int32{x, 3}, par, nil, 5)
		if len(out) < 1 || len(out) > 3 {
			t.Fatalf("seed %d: %d tokens for one row of drafts plus one", s, len(out))
		}
		for i, d := range out[:len(out)-1] {
			if want := []int32{x, 3}[i]; d.ID != want {
				t.Fatalf("seed %d: accepted %d at row %d, draft %d", s, d.ID, i, want)
			}
		}
		spec[out[0].ID]++
		proposed[x]++
		if out[0].ID == x && len(out) > 1 {
			accepted[x]++
		}
		// the naive verifier keeps every draft
		naive[x]++
		par.Seed = uint64(n + s + 1)
		id, _ := Sample(rows(0), par, nil, 5)
		plain[id]++
	}
	crit := chiSquareCritical(vocab - 1)
	if x := chiSquare(spec, p, n); x > crit {
		t.Errorf("speculative frequencies %v against p %v: chi-square %.1f > %.1f", spec, p, x, crit)
	}
	if x := chiSquare(naive, p, n); x <= crit {
		t.Errorf("the always-accept verifier passes (chi-square %.1f <= %.1f): the test has no power", x, crit)
	}
	// two samples: sum (a-b)^2/(a+b) is chi-square with vocab-1 dof
	var two float64
	for i := range spec {
		if a, b := float64(spec[i]), float64(plain[i]); a+b > 0 {
			two += (a - b) * (a - b) / (a + b)
		}
	}
	if two > crit {
		t.Errorf("speculative %v and plain %v frequencies differ: chi-square %.1f > %.1f", spec, plain, two, crit)
	}
	for x := range proposed {
		m := float64(proposed[x])
		z := (float64(accepted[x]) - m*p[x]) / math.Sqrt(m*p[x]*(1-p[x]))
		if math.Abs(z) > 3.29 { // two-sided 1e-3
			t.Errorf("draft %d accepted %d of %d times, p=%.3f (z=%.1f)", x, accepted[x], proposed[x], p[x], z)
		}
	}
}

// Greedy verification accepts exactly the drafts that are the argmax and
// answers the argmax after them; with the penalty it sees each row's history.
func TestVerifyGreedy(t *testing.T) {
	rows := [][]float32{{0, 5, 1}, {4, 0, 1}, {0, 0, 9}}
	get := func(i int) []float32 { return append([]float32(nil), rows[i]...) }
	cases := []struct {
		drafts []int32
		want   []int32
	}{
		{[]int32{1, 0}, []int32{1, 0, 2}}, // all accepted, plus the bonus token
		{[]int32{1, 2}, []int32{1, 0}},    // the second draft fails: corrected
		{[]int32{2, 0}, []int32{1}},       // the first fails
		{nil, []int32{1}},                 // no drafts: a plain step
	}
	for _, c := range cases {
		out := Verify(get, c.drafts, Params{}, nil, 0)
		var ids []int32
		for _, d := range out {
			ids = append(ids, d.ID)
		}
		if len(ids) != len(c.want) {
			t.Errorf("drafts %v: %v, want %v", c.drafts, ids, c.want)
			continue
		}
		for i := range ids {
			if ids[i] != c.want[i] {
				t.Errorf("drafts %v: %v, want %v", c.drafts, ids, c.want)
			}
		}
	}
	// A repetition penalty of 100 on row 1's history {0, 1} makes 2 the argmax there.
	hist := [][]int32{{}, {0, 1}, {0, 1, 2}}
	out := Verify(get, []int32{1, 0}, Params{RepetitionPenalty: 100}, func(i int) []int32 { return hist[i] }, 0)
	if len(out) != 2 || out[1].ID != 2 {
		t.Errorf("penalized verify %+v, want the second draft rejected for 2", out)
	}
}
