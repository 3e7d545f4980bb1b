package engine

import (
	"fmt"
	"math"
	"testing"

	"meshgpu/internal/testenv"
)

// The tracker's audit bounds (auditTieTolerance and
// DefaultAuditTolerance, nats), restated: importing the tracker would put
// it and its store clients into engine.test, which travels to the GPU host
// inside a 64 MiB transfer.
const (
	auditTieTolerance = 0.1
	auditTolerance    = 0.5
)

// logprobOf is log softmax(l)[id] in float64.
func logprobOf(l []float32, id int32) float64 {
	mx := math.Inf(-1)
	for _, v := range l {
		mx = math.Max(mx, float64(v))
	}
	var sum float64
	for _, v := range l {
		sum += math.Exp(float64(v) - mx)
	}
	return float64(l[id]) - mx - math.Log(sum)
}

// TestCUDAAuditTolerance measures what an audit sees between an honest CPU
// replica and an honest CUDA one (issue 14's calibration, docs/security.md):
// teacher-forced along golden.json's bf16 greedy ids, the logprob of each
// golden token on both backends. The largest gap must stay under the
// tracker's tie tolerance (the tighter of its two bounds), or honest CUDA
// nodes would be flagged against CPU referees.
func TestCUDAAuditTolerance(t *testing.T) {
	cb := openCUDAOrSkip(t)
	dir := testenv.GoCoder(t)
	g := loadGolden(t, dir)
	cpu := loadModel(t, dir, openCPU(t), 0, -1)
	cu := loadModel(t, dir, cb, 0, -1)
	worst := 0.0
	for i, gen := range g.Generations {
		ids := gen.BF16.GreedyIDs
		cs, err := cpu.Stack.NewSession(len(gen.PromptIDs) + len(ids))
		if err != nil {
			t.Fatal(err)
		}
		us, err := cu.Stack.NewSession(len(gen.PromptIDs) + len(ids))
		if err != nil {
			t.Fatal(err)
		}
		tokens, pos, gap := gen.PromptIDs, 0, 0.0
		for _, id := range ids {
			d := math.Abs(logprobOf(lastLogits(t, cpu, cs, pos, tokens), id) - logprobOf(lastLogits(t, cu, us, pos, tokens), id))
			gap = math.Max(gap, d)
			pos += len(tokens)
			tokens = []int32{id}
		}
		cs.Close()
		us.Close()
		worst = math.Max(worst, gap)
		fmt.Printf("AUDIT prompt %d: cpu vs cuda logprob of golden's token, largest gap %.4f nats over %d steps\n", i, gap, len(ids))
	}
	status := "ok"
	if !(worst < auditTieTolerance) {
		status = "FAIL"
		t.Errorf("cpu vs cuda logprob gap %.4f nats, want < the audit tie tolerance %g", worst, auditTieTolerance)
	}
	fmt.Printf("AUDIT cpu vs cuda: largest logprob gap %.4f nats (tie tolerance %g, tolerance %g)  %s\n", worst,
		auditTieTolerance, auditTolerance, status)
}
