//go:build !(darwin || linux || openbsd)

package relay

import (
	"errors"
	"net"
)

// fastWriter is unix-only; elsewhere every frame goes through the queue.
type fastWriter struct{}

var errWouldBlock = errors.New("would block")

func newFastWriter(*net.TCPConn) *fastWriter { return nil }

func (*fastWriter) write(head, body []byte) (int, bool, error) { return 0, false, nil }
