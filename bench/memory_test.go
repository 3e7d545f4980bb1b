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

// A decode step reads the file's tensors as stored: a Q4_K_M file's blocks,
// not the bf16 bytes of its shapes (the count bench decode printed before,
// 198% of the bandwidth on a Q4_K_M Llama).
func TestDecodeBytesAreTheFilesTensors(t *testing.T) {
	path := testenv.GoCoderGGUF(t, "q4_k_m")
	mc, err := model.LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	got, err := weightBytesPerToken(path, mc, 0, mc.NumLayers-1, true)
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
		if strings.HasPrefix(ti.Name, "blk.") || ti.Name == "output_norm.weight" {
			want += int64(ti.Size)
		}
	}
	head, ok := f.Tensor("output.weight")
	if !ok {
		head, ok = f.Tensor("token_embd.weight") // tied
	}
	if !ok {
		t.Fatal("no LM head or embeddings in the file")
	}
	want += int64(head.Size)
	if got != want {
		t.Fatalf("decode reads %d bytes per token, the file's layers, final norm and head hold %d", got, want)
	}
	if bf16 := int64(mc.NumLayers) * mc.LayerBytes(model.BF16); got >= bf16 {
		t.Fatalf("a Q4_K_M file's %d bytes per token are not below the bf16 layers' %d", got, bf16)
	}
}
