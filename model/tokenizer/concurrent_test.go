package tokenizer

import (
	"slices"
	"sync"
	"testing"
)

// TestConcurrentEncode: one Tokenizer serves many goroutines (the shared
// word cache is the only mutable state); run with -race.
func TestConcurrentEncode(t *testing.T) {
	tok, cases := goCoderCases(t)
	var wg sync.WaitGroup
	errs := make(chan string, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := 0; r < 20; r++ {
				for _, c := range cases {
					if got := tok.Encode(c.Text, true); !slices.Equal(got, c.IDsWithBOS) {
						errs <- c.Text
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for text := range errs {
		t.Errorf("concurrent Encode(%q) differs from the reference", text)
	}
}
