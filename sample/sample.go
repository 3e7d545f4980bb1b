// Package sample picks the next token from logits: greedy, or temperature
// with top-k, top-p and min-p filters and a repetition penalty, following HF
// transformers' logits processors, plus OpenAI's presence and frequency
// penalties. Draws are a pure function of (seed, step, logits), so a retried
// or replayed step picks the same token on any node.
//
// The native samplers (native/cpu_sample.c, kernels/sample.cu) compute the
// same thing bit for bit: every probability is expNeg of the same float64,
// every sum over the vocabulary is the sum, in chunk order, of sumChunks
// fixed chunks each summed in index order (so a GPU sums the chunks in
// parallel), and the draw walks the chunk sums before the tokens.
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

// MaxTopLogprobs bounds Params.TopLogprobs (OpenAI's limit).
const MaxTopLogprobs = wire.MaxTopLogprobs

// Sample picks the next token. logits may be modified. history holds the
// tokens the repetition penalty applies to (HF semantics: each distinct id's
// positive logit is divided by the penalty, a negative one multiplied). step
// is the index of the generated token; the draw depends only on (Seed, step,
// logits). It returns the id and its log-probability under the final
// distribution (after penalty, temperature and filters; greedy: the
// log-softmax of the penalized logits). logits must not be empty. Logits
// with no finite distribution (an infinite logit, all NaN or all -Inf, as a
// numerical blow-up gives) pick the largest logit with logprob 0, so the
// logprob is always finite. The presence and frequency penalties count
// history's last step ids as the generated ones (Choose with generatedFrom
// len(history)-step).
func Sample(logits []float32, p Params, history []int32, step int) (id int32, logprob float32) {
	p.Logprobs, p.TopLogprobs = false, 0
	c := Choose(logits, p, history, max(len(history)-step, 0), step)
	return c.ID, c.Logprob
}

// Choice is a picked token.
type Choice struct {
	ID      int32
	Logprob float32
	// With Params.Logprobs or TopLogprobs: ModelLogprob is the chosen
	// token's log-probability under the model's distribution (the
	// log-softmax of the penalized logits, before temperature and filters,
	// as vLLM and OpenAI report it), and Top the TopLogprobs most likely
	// tokens of it, most likely first, ties by lower id; both zero/empty
	// when that distribution is not finite.
	ModelLogprob float32
	Top          []Candidate
}

// Candidate is a token and its log-probability (defined in wire: it
// travels in the token reply).
type Candidate = wire.Candidate

// TokenLogprobs is what a sampling node reports for Params.Logprobs
// (wire.TokenLogprobs).
type TokenLogprobs = wire.TokenLogprobs

// Logprobs computes TokenLogprobs of id with k alternatives from logits
// (after Sample, which leaves the penalized logits in place): the model's
// log-softmax, as Choose reports it; zero when that distribution is not
// finite.
func Logprobs(logits []float32, id int32, k int) TokenLogprobs {
	lse := logSumExp(logits)
	if math.IsNaN(lse) || math.IsInf(lse, 0) || id < 0 || int(id) >= len(logits) {
		return TokenLogprobs{}
	}
	out := TokenLogprobs{Logprob: float32(float64(logits[id]) - lse)}
	if k > 0 {
		out.Top = topLogprobs(logits, lse, k)
	}
	return out
}

// Choose is Sample where history[generatedFrom:] are the generated tokens
// the presence and frequency penalties count (history[:generatedFrom] is
// the prompt), and with the top logprobs when p asks for them. Penalties
// apply in that order: repetition (whole history), then presence and
// frequency (generated tokens), then temperature and the filters.
func Choose(logits []float32, p Params, history []int32, generatedFrom int, step int) Choice {
	if len(logits) == 0 {
		return Choice{ID: -1, Logprob: float32(math.Inf(-1))}
	}
	if r := p.RepetitionPenalty; r != 0 && r != 1 {
		penalize(logits, history, float32(r))
	}
	if (p.PresencePenalty != 0 || p.FrequencyPenalty != 0) && generatedFrom < len(history) {
		penalizeGenerated(logits, history[max(generatedFrom, 0):], p.PresencePenalty, p.FrequencyPenalty)
	}
	var c Choice
	var lse float64
	if p.Logprobs || p.TopLogprobs > 0 {
		lse = logSumExp(logits)
		if math.IsNaN(lse) || math.IsInf(lse, 0) {
			p.Logprobs, p.TopLogprobs = false, 0
		}
	}
	if p.TopLogprobs > 0 {
		c.Top = topLogprobs(logits, lse, p.TopLogprobs)
	}
	c.ID, c.Logprob = pick(logits, p, step)
	if p.Logprobs || p.TopLogprobs > 0 {
		c.ModelLogprob = float32(float64(logits[c.ID]) - lse)
	}
	return c
}

func pick(logits []float32, p Params, step int) (int32, float32) {
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
	var parts [sumChunks]float64
	total := inChunksParts(len(probs), func(lo, hi int) float64 {
		var s float64
		for _, q := range probs[lo:hi] {
			s += q
		}
		return s
	}, &parts)
	if !(total > 0) {
		return int32(argmax(logits)), 0
	}
	// the conversion rounds the product: no fused multiply-add with draw's subtractions
	i := draw(probs, &parts, float64(uniform(p.Seed, step)*total))
	return int32(i), float32(math.Log(probs[i] / total))
}

// draw walks u down the chunk sums, then down the tokens of the chunk it
// lands in, and returns the token it lands on. Rounding may leave u at or
// above a chunk's last kept token or above the whole sum: then the last
// kept token of that chunk (or of all) is picked.
func draw(probs []float64, parts *[sumChunks]float64, u float64) int {
	n := len(probs)
	last := -1
	for c := 0; c < sumChunks; c++ {
		lo, hi := chunkBounds(n, c)
		if !(u < parts[c]) {
			u -= parts[c]
			for i := hi - 1; i >= lo; i-- {
				if probs[i] > 0 {
					last = i
					break
				}
			}
			continue
		}
		for i := lo; i < hi; i++ {
			q := probs[i]
			if q == 0 {
				continue
			}
			last = i
			if u < q {
				return i
			}
			u -= q
		}
		return last
	}
	return last
}

// penalizeGenerated applies OpenAI's presence and frequency penalties: each
// distinct generated id in the vocabulary loses frequency*count + presence.
func penalizeGenerated(logits []float32, generated []int32, presence, frequency float64) {
	count := make(map[int32]int, len(generated))
	for _, id := range generated {
		if id >= 0 && int(id) < len(logits) {
			count[id]++
		}
	}
	for id, n := range count {
		// (l - frequency*n) - presence, each step rounded (no fused
		// multiply-add): the native samplers compute the same bits
		logits[id] = float32(float64(float64(logits[id])-float64(frequency*float64(n))) - presence)
	}
}

// logSumExp is the log-softmax's normalizer, max + log(sum e^(x - max)).
func logSumExp(logits []float32) float64 {
	mx, s := sumExp(logits)
	return mx + math.Log(s)
}

// topLogprobs returns the n largest entries of the log-softmax of logits
// (normalizer lse; NaN excluded), largest first, ties by lower id.
func topLogprobs(logits []float32, lse float64, n int) []Candidate {
	n = min(n, len(logits))
	top := make([]int, 0, n+1)
	for i, v := range logits {
		if math.IsNaN(float64(v)) {
			continue
		}
		// insert i after every entry at least as large (ties: lower id first)
		k := len(top)
		for k > 0 && logits[top[k-1]] < v {
			k--
		}
		if k >= n {
			continue
		}
		top = slices.Insert(top, k, i)
		if len(top) > n {
			top = top[:n]
		}
	}
	out := make([]Candidate, len(top))
	for j, i := range top {
		out[j] = Candidate{ID: int32(i), Logprob: float32(float64(logits[i]) - lse)}
	}
	return out
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

func logSoftmaxAt(x []float32, i int) float64 {
	mx, s := sumExp(x)
	return float64(x[i]) - mx - math.Log(s)
}

// sumExp returns the largest logit and the sum of e^(x - it) over the
// non-NaN logits (in chunks: the log-softmax's denominator).
func sumExp(x []float32) (mx, s float64) {
	mx = float64(x[argmax(x)])
	s = inChunks(len(x), func(lo, hi int) float64 {
		var s float64
		for _, v := range x[lo:hi] {
			if !math.IsNaN(float64(v)) {
				s += expNeg(float64(v) - mx)
			}
		}
		return s
	})
	return mx, s
}

// Every sum over the vocabulary is the sum, in order, of sumChunks fixed
// chunks (chunkBounds), each summed in index order: the native samplers
// compute the same bits, a GPU summing the chunks in parallel. Vocabularies
// of parallelMin and more run the chunks on parallelWorkers goroutines: the
// exponentials of a 128k vocabulary take about a millisecond on one core, a
// lot next to a GPU decode step.
const (
	sumChunks       = 256
	parallelMin     = 1 << 15
	parallelWorkers = 8
)

// chunkBounds is chunk c of [0, n).
func chunkBounds(n, c int) (lo, hi int) {
	return int(int64(n) * int64(c) / sumChunks), int(int64(n) * int64(c+1) / sumChunks)
}

// inChunks runs f over the sumChunks chunks of [0, n) and returns the sum
// of their results in chunk order, so the value depends on neither
// scheduling nor the core count. It returns when every chunk is done.
func inChunks(n int, f func(lo, hi int) float64) float64 {
	var parts [sumChunks]float64
	return inChunksParts(n, f, &parts)
}

// inChunksParts is inChunks that also keeps each chunk's result.
func inChunksParts(n int, f func(lo, hi int) float64, parts *[sumChunks]float64) float64 {
	if n < parallelMin {
		for c := range parts {
			lo, hi := chunkBounds(n, c)
			parts[c] = f(lo, hi)
		}
	} else {
		var wg sync.WaitGroup
		for w := 0; w < parallelWorkers; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for c := w; c < sumChunks; c += parallelWorkers {
					lo, hi := chunkBounds(n, c)
					parts[c] = f(lo, hi)
				}
			}()
		}
		wg.Wait()
	}
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
	}
	total = inChunks(len(probs), func(lo, hi int) float64 {
		var s float64
		for _, q := range probs[lo:hi] {
			s += q
		}
		return s
	})
	out = make([]int, 0, 256)
	for t := mx / 1024; ; t /= 1024 {
		if t < 1e-300 {
			t = 0
		}
		out = out[:0]
		for i, q := range probs {
			if q > 0 && q >= t {
				out = append(out, i)
			}
		}
		if t == 0 || (topK && len(out) >= p.TopK) {
			return out, total
		}
		if !topK {
			mass := inChunks(len(probs), func(lo, hi int) float64 {
				var s float64
				for _, q := range probs[lo:hi] {
					if q > 0 && q >= t {
						s += q
					}
				}
				return s
			})
			if mass >= p.TopP*total {
				return out, total
			}
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
