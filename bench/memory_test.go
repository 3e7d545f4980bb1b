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
	want := fileTensorBytes(t, path, func(name string) bool {
		return strings.HasPrefix(name, "blk.2.") || strings.HasPrefix(name, "blk.3.")
	})
	if got != want || want == 0 {
		t.Fatalf("floor %d bytes, the file's blk.2/blk.3 tensors hold %d", got, want)
	}
	// The tail adds the final norm and the (tied) embedding once.
	tail, err := storedBytes(path, mc, 4, 5)
	if err != nil {
		t.Fatal(err)
	}
	ends := fileTensorBytes(t, path, func(name string) bool { return name == "token_embd.weight" || name == "output_norm.weight" })
	if tail != want+ends {
		t.Fatalf("tail floor %d, want %d", tail, want+ends)
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
	want := fileTensorBytes(t, path, func(name string) bool {
		return strings.HasPrefix(name, "blk.") || name == "output_norm.weight"
	})
	head := fileTensorBytes(t, path, func(name string) bool { return name == "output.weight" })
	if head == 0 {
		head = fileTensorBytes(t, path, func(name string) bool { return name == "token_embd.weight" }) // tied
	}
	if head == 0 {
		t.Fatal("no LM head or embeddings in the file")
	}
	want += head
	if got != want {
		t.Fatalf("decode reads %d bytes per token, the file's layers, final norm and head hold %d", got, want)
	}
	if bf16 := int64(mc.NumLayers) * mc.LayerBytes(model.BF16); got >= bf16 {
		t.Fatalf("a Q4_K_M file's %d bytes per token are not below the bf16 layers' %d", got, bf16)
	}
}

// fileTensorBytes sums the stored sizes of the GGUF file's tensors whose
// names keep takes, read from the file's own tensor table.
func fileTensorBytes(t *testing.T, path string, keep func(name string) bool) int64 {
	t.Helper()
	f, err := gguf.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var n int64
	for _, ti := range f.Tensors {
		if keep(ti.Name) {
			n += int64(ti.Size)
		}
	}
	return n
}

// --prefill measures again after a prompt through all layers (the row
// reports its tokens and the file-size bound's ratio); a prompt longer than
// the session or a partial range is one error.
func TestMemoryAfterPrefill(t *testing.T) {
	path := testenv.GoCoderGGUF(t, "q4_k_m")
	rep, err := Memory(context.Background(), MemoryConfig{Backend: smokeBackend, Model: ModelSource{Dir: path}, MaxContext: 64, Prefill: 64})
	if err != nil {
		t.Fatal(err)
	}
	row, ok := rep.Find("rss_after_prefill", 6)
	if !ok || row.P50 <= 0 || row.Extra["prefill_tokens"] != 64 || !(row.Extra["rss_over_file_plus_kv"] > 0) {
		t.Fatalf("rows %+v", rep.Rows)
	}
	for _, c := range []struct {
		cfg  MemoryConfig
		want string
	}{
		{MemoryConfig{Backend: smokeBackend, Model: ModelSource{Dir: path}, MaxContext: 32, Prefill: 33}, "more than the session's --max-context 32"},
		{MemoryConfig{Backend: smokeBackend, Model: ModelSource{Dir: path}, Layers: "2-3", MaxContext: 32, Prefill: 8}, "needs all layers"},
	} {
		if _, err := Memory(context.Background(), c.cfg); err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("prefill %d, layers %q: error %v, want one line with %q", c.cfg.Prefill, c.cfg.Layers, err, c.want)
		}
	}
}
