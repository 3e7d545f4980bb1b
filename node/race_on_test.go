//go:build race

package node

// raceEnabled: the race detector changes allocation counts and slows the
// CPU several-fold, so measurements that depend on them are skipped.
const raceEnabled = true
