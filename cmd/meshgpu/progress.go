package main

import (
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// progress reports bytes done of a long step (loading a model's tensors,
// writing synthesized weights) for engine.Options.Progress and
// model.SynthOptions.Progress: a bar when stderr is a terminal, otherwise
// plain log lines, one every 2 s and one at the end of a pass that took a
// second or more (a quick load logs nothing, so CI logs and one-line error
// output stay short). A new pass (done going back to the start, or a new
// total) starts a new bar, so one progress can follow several loads.
type progress struct {
	what string
	tty  io.Writer // nil: log lines
	log  *slog.Logger

	now func() time.Time // time.Now; tests drive it

	bar       *progressbar.ProgressBar
	total     int64
	last      int64
	passStart time.Time
	lastLog   time.Time
}

// newProgress makes a progress for what ("loading layers 0-5"). Call Update
// as bytes are done and Finish when the step ends (even on error).
func newProgress(what string) *progress {
	p := &progress{what: what, log: slog.Default(), now: time.Now}
	if term.IsTerminal(int(os.Stderr.Fd())) {
		p.tty = os.Stderr
	}
	return p
}

// Update is the progress callback.
func (p *progress) Update(done, total int64) {
	if total <= 0 {
		return
	}
	if done < p.last || total != p.total {
		p.endPass()
		p.total = total
		p.passStart = p.now()
		p.lastLog = p.passStart
	}
	p.last = done
	if p.tty != nil {
		if p.bar == nil {
			p.bar = progressbar.NewOptions64(total, progressbar.OptionSetWriter(p.tty),
				progressbar.OptionShowBytes(true), progressbar.OptionSetDescription(p.what),
				progressbar.OptionSetWidth(30), // no throttle: one render per tensor, and the last state of a failed load shows
				progressbar.OptionOnCompletion(func() { io.WriteString(p.tty, "\n") }),
				progressbar.OptionSetRenderBlankState(true)) // the start: the rate counts from here
		}
		p.bar.Set64(done)
		if done >= total {
			p.bar = nil // Set64 to the max finished it
		}
		return
	}
	now := p.now()
	if (done >= total && now.Sub(p.passStart) >= time.Second) || (done < total && now.Sub(p.lastLog) >= 2*time.Second) {
		p.lastLog = now
		p.log.Info(p.what, "done_bytes", done, "total_bytes", total, "percent", 100*done/total)
	}
}

// endPass closes a bar left unfinished (a failed step).
func (p *progress) endPass() {
	if p.bar != nil {
		p.bar.Exit() // its completion hook ends the line
		p.bar = nil
	}
	p.last, p.total = 0, 0
}

// Finish ends the current pass; the progress can be reused.
func (p *progress) Finish() { p.endPass() }
