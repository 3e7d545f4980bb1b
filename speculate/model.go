package speculate

import (
	"context"
	"fmt"

	"meshgpu/engine"
	"meshgpu/native"
	"meshgpu/sample"
)

// Model drafts with a small model that shares the target's vocabulary, on
// the head's backend: greedily (its argmax), so the draft distribution is
// one-hot and only ids travel with the verify hop (sample.Verify). It holds
// one KV cache for one generation; tokens it fed that the target rejected
// are dropped by feeding the next pass from the first position history and
// its cache disagree (a forward below the cache's length truncates it).
type Model struct {
	m      *engine.Model
	sess   native.Session
	fed    []int32 // ids at the cache's positions
	act    []byte
	logits []float32
}

// CheckDraftModel refuses a draft model that cannot draft for target: it
// must hold every layer and have the same vocabulary.
func CheckDraftModel(draft, target *engine.Model) error {
	if !draft.HasEmbed() || !draft.HasHead() {
		return fmt.Errorf("the draft model must hold all its layers, it holds %d-%d", draft.First, draft.Last)
	}
	if draft.Config.Vocab != target.Config.Vocab {
		return fmt.Errorf("the draft model's vocabulary has %d tokens and the model's %d; a draft model needs the same tokenizer", draft.Config.Vocab, target.Config.Vocab)
	}
	return nil
}

// NewModel opens a draft cache of maxTokens on m.
func NewModel(m *engine.Model, maxTokens int) (*Model, error) {
	sess, err := m.Stack.NewSession(maxTokens)
	if err != nil {
		return nil, fmt.Errorf("draft model: %w", err)
	}
	return &Model{m: m, sess: sess, logits: make([]float32, m.Config.Vocab)}, nil
}

// Propose implements Drafter: it feeds the part of history its cache lacks
// in one step, then drafts k tokens one step each.
func (d *Model) Propose(ctx context.Context, history []int32, k int) ([]int32, error) {
	if k <= 0 || len(history) == 0 {
		return nil, nil
	}
	common := 0
	for common < len(d.fed) && common < len(history) && d.fed[common] == history[common] {
		common++
	}
	if common == len(history) {
		common-- // refeed the last token for its logits
	}
	limit := d.m.Stack.Config().MaxContext
	var out []int32
	pos, feed := common, history[common:]
	d.fed = d.fed[:common]
	for len(out) < k {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if pos+len(feed) > limit {
			break
		}
		if err := d.step(pos, feed); err != nil {
			d.fed = nil // the cache is in doubt: refeed everything next time
			return nil, err
		}
		d.fed = append(d.fed, feed...)
		id, _ := sample.Sample(d.logits, sample.Params{}, nil, 0)
		out = append(out, id)
		pos += len(feed)
		feed = out[len(out)-1:]
	}
	return out, nil
}

func (d *Model) step(pos int, tokens []int32) error {
	n := len(tokens)
	row := d.m.Config.Hidden * native.F32.Size()
	if cap(d.act) < n*row {
		d.act = make([]byte, n*row)
	}
	act := d.act[:n*row]
	return engine.RunStep([]engine.Stage{{Stack: d.m.Stack, Session: d.sess, First: d.m.First, Last: d.m.Last}}, pos, n, tokens, native.F32, act, d.logits)
}

// Close frees the draft cache.
func (d *Model) Close() {
	if d.sess != nil {
		d.sess.Close()
		d.sess = nil
	}
}
