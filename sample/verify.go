package sample

// Draw is one sampled token and its log-probability.
type Draw struct {
	ID      int32
	Logprob float32
}

// Verify is speculative sampling's acceptance over the rows of a verify
// pass: rows(i) are the logits after the pass's i-th token (the last
// accepted token, then the drafts), drafts are the proposed tokens (one
// fewer than the rows), history(i) the repetition-penalty history at row i
// and step the index of the token row 0 generates. It returns the accepted
// drafts and then one more token: the one sampled where the first draft
// failed, or after the last draft.
//
// Drafts are deterministic (prompt lookup, or a draft model's argmax), so
// the draft distribution q is one-hot on the draft x. Speculative sampling
// (Leviathan et al. 2023, Chen et al. 2023) then accepts x with probability
// min(1, p(x)/q(x)) = p(x) and otherwise samples from normalize(max(p-q, 0)),
// which is p with x removed. Verify realises both with the row's own seeded
// draw y = Sample(row, step+i): it accepts x when y == x (probability p(x))
// and otherwise answers y, which given y != x is distributed as p without
// x. So the output keeps p's distribution exactly, and it is the very
// token plain decoding draws at that step: speculative and plain decoding
// of one seed give the same text, and a replayed request (failover) too.
// Greedy (temperature 0) is the same rule with y the argmax.
func Verify(rows func(i int) []float32, drafts []int32, p Params, history func(i int) []int32, step int) []Draw {
	out := make([]Draw, 0, len(drafts)+1)
	for i := 0; ; i++ {
		var hist []int32
		if p.NeedsHistory() && history != nil {
			hist = history(i)
		}
		id, lp := Sample(rows(i), p, hist, step+i)
		out = append(out, Draw{ID: id, Logprob: lp})
		if i == len(drafts) || id != drafts[i] {
			return out
		}
	}
}
