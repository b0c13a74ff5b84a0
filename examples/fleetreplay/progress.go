package main

import (
	"fmt"
	"io"
	"strings"
	"time"
)

// progress draws a progress bar of requests replayed on a terminal, once the
// replay has run for more than a moment.
type progress struct {
	w       io.Writer
	total   int
	done    int
	start   time.Time
	last    time.Time
	shown   bool
	enabled bool
}

// delay is how long a replay runs before the bar appears.
const delay = 1500 * time.Millisecond

func newProgress(w io.Writer, total int, enabled bool) *progress {
	now := time.Now()
	return &progress{w: w, total: total, start: now, last: now, enabled: enabled}
}

// add counts n more requests replayed.
func (p *progress) add(n int) {
	p.done += n
	if !p.enabled {
		return
	}
	now := time.Now()
	if now.Sub(p.start) < delay || (now.Sub(p.last) < 100*time.Millisecond && p.done < p.total) {
		return
	}
	p.last = now
	p.shown = true
	const width = 30
	frac := float64(p.done) / float64(max(p.total, 1))
	n = int(frac * width)
	fmt.Fprintf(p.w, "\rreplaying [%s%s] %3.0f%%  %d/%d requests  %.0fs ",
		strings.Repeat("=", n), strings.Repeat(" ", width-n), 100*frac, p.done, p.total, now.Sub(p.start).Seconds())
}

// finish clears the bar.
func (p *progress) finish() {
	if p.shown {
		fmt.Fprintf(p.w, "\r%s\r", strings.Repeat(" ", 80))
	}
}
