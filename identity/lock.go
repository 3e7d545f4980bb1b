package identity

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// ErrInUse is Acquire's error when another process holds the key.
var ErrInUse = errors.New("identity: the key is in use by another meshgpu process")

// Acquire loads or creates the key at path and holds an exclusive lock on
// it until release, so two nodes on one machine cannot run under the same
// peer id by accident (the relay and the tracker would take them for one).
func Acquire(path string) (id *Identity, release func(), err error) {
	id, err = LoadOrCreate(path)
	if err != nil {
		return nil, nil, err
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, fmt.Errorf("identity: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("%w: %s", ErrInUse, path)
	}
	return id, func() { f.Close() }, nil
}
