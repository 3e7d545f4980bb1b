//go:build race

package relay

// raceEnabled: the race detector changes allocation counts and slows the
// CPU several-fold, so measurements that depend on them are skipped.
const raceEnabled = true
