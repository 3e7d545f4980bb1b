package bench

import (
	"context"
	"strings"
	"testing"

	"meshgpu/internal/testenv"
	"meshgpu/model"
	"meshgpu/model/gguf"
)

// The floor counts exactly the tensors of the range, as the file's own
// infos list them: blk.2.* and blk.3.* of the GGUF.
func TestMemoryFloorIsTheRangesTensors(t *testing.T) {
	path := testenv.GoCoderGGUF(t, "bf16")
	mc, err := model.LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	got, err := storedBytes(path, mc, 2, 3)
	if err != nil {
		t.Fatal(err)
	}
	f, err := gguf.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var want int64
	for _, ti := range f.Tensors {
		if strings.HasPrefix(ti.Name, "blk.2.") || strings.HasPrefix(ti.Name, "blk.3.") {
			want += int64(ti.Size)
		}
	}
	if got != want || want == 0 {
		t.Fatalf("floor %d bytes, the file's blk.2/blk.3 tensors hold %d", got, want)
	}
	// The tail adds the final norm and the (tied) embedding once.
	tail, err := storedBytes(path, mc, 4, 5)
	if err != nil {
		t.Fatal(err)
	}
	emb, _ := f.Tensor("token_embd.weight")
	norm, _ := f.Tensor("output_norm.weight")
	if tail != want+int64(emb.Size+norm.Size) {
		t.Fatalf("tail floor %d, want %d", tail, want+int64(emb.Size+norm.Size))
	}
}

func TestMemorySuiteRuns(t *testing.T) {
	rep, err := Memory(context.Background(), MemoryConfig{Backend: smokeBackend, Model: ModelSource{Dir: testenv.GoCoderGGUF(t, "bf16")}, Layers: "2-3", MaxContext: 64})
	if err != nil {
		t.Fatal(err)
	}
	row, ok := rep.Find("rss", 2)
	if !ok || row.P50 <= 0 || row.Extra["floor_MiB"] <= 0 {
		t.Fatalf("rows %+v", rep.Rows)
	}
}
