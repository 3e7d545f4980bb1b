package engine

import (
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/model"
	"meshgpu/native"
)

// Options.Progress counts the bytes copied onto the stack: it starts at 0
// (so a progress bar starts empty and measures its rate from the start of
// the load, not from the first tensor), only grows, ends at its total, and the total is what config.json says layers 2-3
// weigh in the checkpoint's dtype (computed from the shapes, not from the
// loader).
func TestLoadProgress(t *testing.T) {
	dir := testenv.GoCoder(t)
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	dt, err := model.ParseDType(cfg.TorchDType)
	if err != nil {
		t.Fatal(err)
	}
	var want int64
	for _, s := range cfg.Tensors(2, 3, false, false) {
		want += s.Elements() * int64(dt.Size())
	}
	be, err := native.Open("cpu", native.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	var calls int
	var last, total int64
	m, err := Load(dir, Options{Backend: be, First: 2, Last: 3, MaxContext: 16, Progress: func(done, tot int64) {
		if calls == 0 && done != 0 || calls > 0 && done <= last || (total != 0 && tot != total) || done > tot {
			t.Errorf("call %d: done %d of %d after %d of %d", calls, done, tot, last, total)
		}
		calls++
		last, total = done, tot
	}})
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
	if n := len(cfg.Tensors(2, 3, false, false)); calls != n+1 || last != total || total != want {
		t.Errorf("%d calls ending at %d of %d; want %d calls (0, then one per tensor) ending at %d of %d", calls, last, total, n+1, want, want)
	}
}
