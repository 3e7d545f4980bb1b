// Package sample picks the next token from logits: greedy, or temperature
// with top-k, top-p and min-p filters and a repetition penalty, following HF
// transformers' logits processors. Draws are a pure function of (seed, step,
// logits), so a retried or replayed step picks the same token on any node.
package sample

import (
	"math"
	"slices"
	"sync"

	"meshgpu/wire"
)

// Params are the sampling settings of one request; the type is defined
// once, in package wire, since it travels on hops.
type Params = wire.SamplingParams

// Sample picks the next token. logits may be modified: on return they hold
// the penalized logits. history holds the ids at positions 0..len-1 (prompt,
// then generated), read only when p.NeedsHistory(): the repetition penalty
// applies to all of it (HF semantics: each distinct id's positive logit is
// divided by the penalty, a negative one multiplied), the presence and
// frequency penalties to its last step ids, the generated ones. step
// is the index of the generated token; the draw depends only on (Seed, step,
// logits). It returns the id and its log-probability under the final
// distribution (after penalty, temperature and filters; greedy: the
// log-softmax of the penalized logits). logits must not be empty. Logits
// with no finite distribution (an infinite logit, all NaN or all -Inf, as a
// numerical blow-up gives) pick the largest logit with logprob 0, so the
// logprob is always finite.
func Sample(logits []float32, p Params, history []int32, step int) (id int32, logprob float32) {
	if len(logits) == 0 {
		return -1, float32(math.Inf(-1))
	}
	if r := p.RepetitionPenalty; r != 0 && r != 1 {
		penalize(logits, history, float32(r))
	}
	if p.PresencePenalty != 0 || p.FrequencyPenalty != 0 {
		generated := history
		if step < len(history) {
			generated = history[len(history)-step:]
		}
		penalizeCounts(logits, generated, p.PresencePenalty, p.FrequencyPenalty)
	}
	if p.Temperature == 0 {
		best := argmax(logits)
		lp := logSoftmaxAt(logits, best)
		if math.IsNaN(lp) || math.IsInf(lp, 0) {
			lp = 0
		}
		return int32(best), float32(lp)
	}
	// probabilities of logits/T in float64
	inv := 1 / p.Temperature
	mx := float64(logits[argmax(logits)]) * inv
	probs := make([]float64, len(logits))
	inChunks(len(logits), func(lo, hi int) float64 {
		for i, l := range logits[lo:hi] {
			if !math.IsNaN(float64(l)) { // a NaN logit is never picked
				probs[lo+i] = expNeg(float64(float64(l)*inv) - mx)
			}
		}
		return 0
	})
	filter(probs, p)
	var total float64
	for _, q := range probs {
		total += q
	}
	if !(total > 0) {
		return int32(argmax(logits)), 0
	}
	u := uniform(p.Seed, step) * total
	last := -1
	for i, q := range probs {
		if q == 0 {
			continue
		}
		last = i
		if u < q {
			return int32(i), float32(math.Log(q / total))
		}
		u -= q
	}
	// rounding left u just above the last kept token
	return int32(last), float32(math.Log(probs[last] / total))
}

func penalize(logits []float32, history []int32, r float32) {
	seen := make(map[int32]bool, len(history))
	for _, id := range history {
		if id < 0 || int(id) >= len(logits) || seen[id] {
			continue
		}
		seen[id] = true
		if l := logits[id]; l > 0 {
			logits[id] = l / r
		} else {
			logits[id] = l * r
		}
	}
}

// penalizeCounts applies OpenAI's presence and frequency penalties: a
// generated id's logit loses frequency*count + presence.
func penalizeCounts(logits []float32, generated []int32, presence, frequency float64) {
	counts := make(map[int32]int, len(generated))
	for _, id := range generated {
		if id >= 0 && int(id) < len(logits) {
			counts[id]++
		}
	}
	for id, n := range counts {
		logits[id] = float32(float64(logits[id]) - frequency*float64(n) - presence)
	}
}

// Candidate is one alternative token (defined in wire: it travels in the
// token reply).
type Candidate = wire.Candidate

// TokenLogprobs is what a sampling node reports for Params.Logprobs
// (wire.TokenLogprobs).
type TokenLogprobs = wire.TokenLogprobs

// Logprobs computes TokenLogprobs of id with k alternatives from logits
// (after Sample, which leaves the penalized logits in place).
func Logprobs(logits []float32, id int32, k int) TokenLogprobs {
	logZ := logSumExp(logits)
	lp := func(i int) float32 {
		v := float64(logits[i]) - logZ
		if math.IsNaN(v) {
			return float32(math.Inf(-1))
		}
		return float32(v)
	}
	out := TokenLogprobs{}
	if id >= 0 && int(id) < len(logits) {
		out.Logprob = lp(int(id))
	}
	if k > len(logits) {
		k = len(logits)
	}
	// keep the k best in a small sorted list: O(V*k) with k <= 20
	top := make([]int, 0, k+1)
	better := func(a, b int) bool {
		va, vb := logits[a], logits[b]
		if math.IsNaN(float64(vb)) && !math.IsNaN(float64(va)) {
			return true
		}
		return va > vb || va == vb && a < b
	}
	for i := range logits {
		if k == 0 {
			break
		}
		if math.IsNaN(float64(logits[i])) {
			continue
		}
		if len(top) == k && !better(i, top[k-1]) {
			continue
		}
		at := len(top)
		for at > 0 && better(i, top[at-1]) {
			at--
		}
		top = slices.Insert(top, at, i)
		if len(top) > k {
			top = top[:k]
		}
	}
	for _, i := range top {
		out.Top = append(out.Top, Candidate{ID: int32(i), Logprob: lp(i)})
	}
	return out
}

// argmax returns the first index of the largest logit (NaN never wins).
func argmax(x []float32) int {
	best := -1
	for i, v := range x {
		if math.IsNaN(float64(v)) {
			continue
		}
		if best < 0 || v > x[best] {
			best = i
		}
	}
	if best < 0 {
		return 0
	}
	return best
}

func logSoftmaxAt(x []float32, i int) float64 { return float64(x[i]) - logSumExp(x) }

// logSumExp is log Σ e^x over the non-NaN entries.
func logSumExp(x []float32) float64 {
	mx := float64(x[argmax(x)])
	s := inChunks(len(x), func(lo, hi int) float64 {
		var s float64
		for _, v := range x[lo:hi] {
			if !math.IsNaN(float64(v)) {
				s += expNeg(float64(v) - mx)
			}
		}
		return s
	})
	return mx + math.Log(s)
}

// Vocabularies of this size and more are split into parallelChunks fixed
// chunks run on their own goroutines: the exponentials of a 128k vocabulary
// take about a millisecond on one core, a lot next to a GPU decode step.
const (
	parallelMin    = 1 << 15
	parallelChunks = 8
)

// inChunks runs f over [0, n) in parallelChunks fixed pieces (one piece
// when n is small) and returns the sum of their results in piece order, so
// the value does not depend on scheduling or the core count. It returns when
// every piece is done.
func inChunks(n int, f func(lo, hi int) float64) float64 {
	if n < parallelMin {
		return f(0, n)
	}
	var parts [parallelChunks]float64
	var wg sync.WaitGroup
	for c := 0; c < parallelChunks; c++ {
		lo, hi := n*c/parallelChunks, n*(c+1)/parallelChunks
		wg.Add(1)
		go func() {
			defer wg.Done()
			parts[c] = f(lo, hi)
		}()
	}
	wg.Wait()
	var s float64
	for _, p := range parts {
		s += p
	}
	return s
}

// expNeg is e^x for x <= 0 (relative error below 1e-11), written with
// explicit roundings so that no platform fuses its multiply-adds: every node
// computes the same bits, where math.Exp has per-architecture versions.
func expNeg(x float64) float64 {
	if !(x >= -708) { // also NaN
		return 0
	}
	if x > 0 {
		return math.Exp(x)
	}
	// e^x = 2^k * e^r, k = round(x / ln 2), |r| <= ln2/2
	k := math.Floor(float64(x*math.Log2E) + 0.5)
	r := float64(x - float64(k*ln2Hi))
	r = float64(r - float64(k*ln2Lo))
	// Taylor series to r^9/9!: |r| <= 0.347 keeps the error below 1e-11
	p := float64(float64(float64(float64(float64(float64(float64(float64(float64(r*(1.0/362880))+1.0/40320)*r)+1.0/5040)*r)+1.0/720)*r)+1.0/120)*r) + 1.0/24
	p = float64(float64(float64(float64(float64(float64(float64(p*r)+1.0/6)*r)+0.5)*r)+1)*r) + 1
	return p * math.Float64frombits(uint64(int64(k)+1023)<<52)
}

const (
	ln2Hi = 6.93147180369123816490e-01
	ln2Lo = 1.90821492927058770002e-10
)

// filter zeroes the probabilities top-k, top-p and min-p remove, in HF's
// order. The most likely token always survives.
func filter(probs []float64, p Params) {
	topP := p.TopP > 0 && p.TopP < 1
	topK := p.TopK > 0 && p.TopK < len(probs)
	if topK || topP {
		order, all := candidates(probs, p, topK, topP)
		// descending probability, ties by id: the kept set is deterministic
		slices.SortFunc(order, func(a, b int) int {
			qa, qb := probs[a], probs[b]
			switch {
			case qa > qb:
				return -1
			case qa < qb:
				return 1
			}
			return a - b
		})
		keep := len(order)
		if topK && p.TopK < keep {
			keep = p.TopK
		}
		if topP {
			// top_p is a share of what top-k left, or of the whole
			// distribution: order holds only candidates, not the tail
			var total float64
			if topK {
				for _, i := range order[:keep] {
					total += probs[i]
				}
			} else {
				total = all
			}
			// keep the smallest prefix whose mass reaches top_p
			var cum float64
			for n, i := range order[:keep] {
				if cum >= p.TopP*total {
					keep = n
					break
				}
				cum += probs[i]
			}
		}
		kept := make([]bool, len(probs))
		for _, i := range order[:keep] {
			kept[i] = true
		}
		for i := range probs {
			if !kept[i] {
				probs[i] = 0
			}
		}
	}
	if p.MinP > 0 {
		var mx float64
		for _, q := range probs {
			mx = math.Max(mx, q)
		}
		for i, q := range probs {
			if q < p.MinP*mx {
				probs[i] = 0
			}
		}
	}
}

// candidates returns the ids of all tokens with probability at least some
// threshold t, lowering t until they surely hold the set top-k/top-p keep:
// tokens at or above t are a prefix of the sorted order, so only they need
// sorting (a few hundred of a 128k vocabulary, not all). total is the mass
// of all tokens.
func candidates(probs []float64, p Params, topK, topP bool) (out []int, total float64) {
	var mx float64
	for _, q := range probs {
		mx = math.Max(mx, q)
		total += q
	}
	out = make([]int, 0, 256)
	for t := mx / 1024; ; t /= 1024 {
		if t < 1e-300 {
			t = 0
		}
		out = out[:0]
		var mass float64
		for i, q := range probs {
			if q > 0 && q >= t {
				out = append(out, i)
				mass += q
			}
		}
		if t == 0 || (topK && len(out) >= p.TopK) || (!topK && mass >= p.TopP*total) {
			return out, total
		}
	}
}

// uniform is a number in [0, 1) determined by (seed, step): splitmix64 of
// both, so nearby seeds and steps give unrelated draws.
func uniform(seed uint64, step int) float64 {
	x := mix(seed ^ 0x9E3779B97F4A7C15)
	x = mix(x ^ uint64(step)*0xD1B54A32D192ED03)
	return float64(x>>11) / (1 << 53)
}

func mix(z uint64) uint64 {
	z += 0x9E3779B97F4A7C15
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}
