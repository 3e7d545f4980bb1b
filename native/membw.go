package native

/*
#include <stddef.h>
double mg_mem_read_gbps(size_t nbytes, int threads, int reps);
*/
import "C"

import "fmt"

// MemReadBandwidth measures the machine's memory read bandwidth in GB/s
// (1e9 bytes/s): threads (0 = all cores) sum an nbytes buffer reps times,
// the way the CPU backend streams weights; the best pass counts.
func MemReadBandwidth(nbytes, threads, reps int) (float64, error) {
	if nbytes < 2<<20 || threads < 0 || threads > 256 || reps <= 0 {
		return 0, fmt.Errorf("memory bandwidth: %d bytes, %d threads, %d reps", nbytes, threads, reps)
	}
	gbps := float64(C.mg_mem_read_gbps(C.size_t(nbytes), C.int(threads), C.int(reps)))
	if gbps < 0 {
		return 0, fmt.Errorf("memory bandwidth: cannot allocate %d bytes", nbytes)
	}
	return gbps, nil
}
