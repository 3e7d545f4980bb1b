// Package deadline moves a connection's read or write deadline on lazily.
//
// Every SetReadDeadline or SetWriteDeadline re-arms a runtime timer; a
// connection that pushes its idle or write timeout on for every frame pays
// that per frame. A Lazy deadline moves only once it has run down by an
// eighth of its timeout, so the timeout holds to within an eighth.
package deadline

import "time"

// Lazy is one deadline of a connection as last set. The zero value has
// none. It is not safe for concurrent use: it belongs to whoever reads (or
// writes) the connection.
type Lazy struct{ at time.Time }

// Extend sets the deadline to timeout from now, through set, unless the
// one set last is still within an eighth of that.
func (l *Lazy) Extend(set func(time.Time) error, timeout time.Duration) {
	now := time.Now()
	if l.at.Sub(now) >= timeout-timeout/8 {
		return
	}
	l.at = now.Add(timeout)
	set(l.at)
}

// Set sets the deadline to t now (zero: none).
func (l *Lazy) Set(set func(time.Time) error, t time.Time) {
	l.at = t
	set(t)
}
