package speculate

import (
	"context"
	"slices"
	"testing"

	"meshgpu/engine"
	"meshgpu/internal/testenv"
	"meshgpu/native"
)

func TestNGramProposesTheLatestLongestMatch(t *testing.T) {
	cases := []struct {
		hist []int32
		k    int
		want []int32
	}{
		// "1 2 3" recurs: the continuation after its earlier occurrence
		{[]int32{1, 2, 3, 4, 5, 9, 1, 2, 3}, 3, []int32{4, 5, 9}},
		// the latest of two matches of the longest suffix wins
		{[]int32{7, 8, 1, 7, 8, 2, 7, 8}, 2, []int32{2, 7}},
		// a longer suffix match beats a more recent shorter one
		{[]int32{5, 6, 1, 9, 6, 2, 5, 6}, 1, []int32{1}},
		// a continuation that reaches the end of history repeats with the
		// match's period
		{[]int32{3, 4, 3}, 5, []int32{4, 3, 4, 3, 4}},
		{[]int32{9, 1, 2, 1, 2}, 3, []int32{1, 2, 1}},
		// nothing recurs
		{[]int32{1, 2, 3}, 4, nil},
		{[]int32{1}, 4, nil},
		{[]int32{1, 1, 1}, 0, nil},
	}
	for _, c := range cases {
		got, _ := NGram{}.Propose(context.Background(), c.hist, c.k)
		if !slices.Equal(got, c.want) {
			t.Errorf("Propose(%v, %d) = %v, want %v", c.hist, c.k, got, c.want)
		}
	}
}

// Drafts that keep failing shrink the length to plain passes with rare
// probes; accepted drafts grow it back, never beyond Max.
func TestLengthAdapts(t *testing.T) {
	l := NewLength(4, 8)
	if k := l.Next(); k != 4 {
		t.Fatalf("starts at %d drafts, want 4", k)
	}
	l.Update(4, 4)
	if k := l.Next(); k != 8 {
		t.Fatalf("after full acceptance %d, want 8", k)
	}
	l.Update(8, 8)
	if k := l.Next(); k != 8 {
		t.Fatalf("grew to %d beyond Max 8", k)
	}
	l.Update(8, 2)
	if k := l.Next(); k != 3 {
		t.Fatalf("after 2 of 8 accepted %d, want 3", k)
	}
	// always rejected: over 1000 passes almost all are plain
	drafted := 0
	for i := 0; i < 1000; i++ {
		k := l.Next()
		drafted += k
		l.Update(k, 0)
	}
	if drafted > 40 {
		t.Errorf("always-rejected drafts: %d drafted tokens over 1000 passes, want few", drafted)
	}
	// a probe that succeeds brings drafting back
	for l.Next() == 0 {
	}
	l.Update(1, 1)
	if k := l.Next(); k != 2 {
		t.Errorf("after a successful probe %d, want 2", k)
	}
	if k := NewLength(4, 0).Next(); k != 0 {
		t.Errorf("Max 0 drafts %d", k)
	}
}

// The draft model drafts its own greedy continuation, also after the
// history diverged from what it drafted (its cache rolls back), and a
// model with another vocabulary is refused.
func TestModelDraftsGreedily(t *testing.T) {
	m := loadGoCoder(t)
	prompt := m.Tokenizer.Encode("func main() {\n\tfmt.Println(", true)
	ref, err := m.Generate(context.Background(), prompt, engine.GenerateParams{MaxTokens: 12, IgnoreEOS: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	d, err := NewModel(m, 256)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx := context.Background()
	hist := append(slices.Clone(prompt), ref.IDs[0])
	got, err := d.Propose(ctx, hist, 4)
	if err != nil || !slices.Equal(got, ref.IDs[1:5]) {
		t.Fatalf("drafts %v (%v), want the greedy %v", got, err, ref.IDs[1:5])
	}
	// Two drafts accepted, then a different token than the third: the
	// next drafts continue from there.
	hist = append(hist, ref.IDs[1], ref.IDs[2], 17)
	got, err = d.Propose(ctx, hist, 3)
	if err != nil {
		t.Fatal(err)
	}
	fresh, _ := NewModel(m, 256)
	defer fresh.Close()
	want, _ := fresh.Propose(ctx, hist, 3)
	if !slices.Equal(got, want) || len(got) != 3 {
		t.Errorf("after a rejection: drafts %v, a fresh cache drafts %v", got, want)
	}

	other := *m
	cfg := *m.Config
	cfg.Vocab++
	other.Config = &cfg
	if err := CheckDraftModel(&other, m); err == nil {
		t.Error("a draft model with another vocabulary was accepted")
	}
	if err := CheckDraftModel(m, m); err != nil {
		t.Error(err)
	}
}

// loadGoCoder loads the whole test model on a CPU backend, closed with t.
func loadGoCoder(t *testing.T) *engine.Model {
	t.Helper()
	be, err := native.Open("cpu", native.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	m, err := engine.Load(testenv.GoCoder(t), engine.Options{Backend: be, Last: -1, MaxContext: 256})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}
