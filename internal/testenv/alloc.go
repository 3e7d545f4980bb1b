package testenv

import "runtime"

// HeapBytesPerRun is the Go heap allocated per call of f: TotalAlloc over
// runs calls after a warm-up, the least of 3 rounds (TotalAlloc is
// process-wide, so this filters out goroutines of earlier tests still
// winding down). Run it without the race detector, which changes counts.
func HeapBytesPerRun(runs int, f func()) int64 {
	best := int64(-1)
	for round := 0; round < 3; round++ {
		f()
		var a, b runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&a)
		for i := 0; i < runs; i++ {
			f()
		}
		runtime.ReadMemStats(&b)
		if n := int64(b.TotalAlloc-a.TotalAlloc) / int64(runs); best < 0 || n < best {
			best = n
		}
	}
	return best
}
