package model

import (
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

var touchSink byte

// A node loading some tensors must not read the others' bytes from disk.
// With the file dropped from the page cache, touching one tensor must leave
// the others' pages (beyond kernel read-around) non-resident.
func TestOnlyTouchedTensorsAreRead(t *testing.T) {
	dir := t.TempDir()
	const mb = 8 << 20
	var ts []Tensor
	for _, name := range []string{"a", "b", "c"} {
		ts = append(ts, Tensor{Name: name, DType: F32, Shape: []int{mb / 4}, Data: make([]byte, mb)})
	}
	path := filepath.Join(dir, singleFile)
	if err := WriteSafetensorsFile(path, ts, nil); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		t.Skipf("fsync: %v", err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Skipf("fadvise: %v", err)
	}
	ck, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if _, err := ck.Info("b"); err != nil { // opens and maps the file
		t.Fatal(err)
	}
	if err := ck.Check(&Config{}, 0, -1, false, false); err != nil { // touches nothing
		t.Fatal(err)
	}
	s := ck.shards[singleFile]
	page := os.Getpagesize()
	resident := func(name string) float64 {
		e := s.hdr.tensors[name]
		begin := (s.hdr.dataStart + e.Begin + int64(page) - 1) / int64(page) * int64(page)
		end := (s.hdr.dataStart + e.End) / int64(page) * int64(page)
		vec := make([]byte, (end-begin)/int64(page))
		m := s.data[begin:end]
		if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
			t.Skipf("mincore: %v", errno)
		}
		n := 0
		for _, v := range vec {
			n += int(v & 1)
		}
		return float64(n) / float64(len(vec))
	}
	if r := resident("a") + resident("b") + resident("c"); r > 0.05 {
		t.Skipf("the page cache kept the file after FADV_DONTNEED (tmpfs?): %.2f resident", r)
	}
	b, err := ck.Tensor("b")
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < len(b.Data); i += page {
		touchSink += b.Data[i]
	}
	if r := resident("b"); r < 0.99 {
		t.Fatalf("touched tensor only %.2f resident", r)
	}
	// At most the pages b shares with its neighbours.
	for _, name := range []string{"a", "c"} {
		if r := resident(name); r > 0.01 {
			t.Errorf("untouched tensor %s is %.2f resident", name, r)
		}
	}
}
