package main

import (
	"fmt"
	"math/rand/v2"
)

// sessionShape draws multi-turn conversations: a system prompt (or a
// document) of sysMin..sysMax tokens, turns of user input and reply, and a
// gap between a reply and the next turn (a tool call, or the user reading).
type sessionShape struct {
	conversations      int
	sysMin, sysMax     int
	turnsMin, turnsMax int
	inMin, inMax       int // user (or tool result) tokens per turn
	outMin, outMax     int // reply tokens per turn
	gapMin, gapMax     float64
	decodePerToken     float64 // s per reply token
	// active bounds the conversations running at once: conversation i
	// starts when conversation i-active has finished (0: all at once).
	active int
	// start spreads the first turns of the first conversations over
	// [0, start) seconds.
	start float64
	// scale divides every token count (the reply's decode time is not
	// scaled); 1 is as published.
	scale int
}

func (sh sessionShape) draw(rng *rand.Rand, lo, hi int) int {
	k := max(sh.scale, 1)
	lo, hi = max(lo/k, 1), max(hi/k, 1)
	return lo + rng.IntN(hi-lo+1)
}

// sessions returns every turn of every conversation in conversation order.
// Only the first turn of each of the first active conversations has a set
// arrival; each later turn arrives gap seconds after its predecessor's
// reply is done.
func sessions(seed uint64, name string, sh sessionShape) []*request {
	rng := rand.New(rand.NewPCG(seed, 0x5e55)) //nolint:gosec // a reproducible workload
	var reqs []*request
	var lasts []*request
	for c := range sh.conversations {
		turns := sh.turnsMin + rng.IntN(sh.turnsMax-sh.turnsMin+1)
		sys := sh.draw(rng, sh.sysMin, sh.sysMax)
		ins := make([]int, turns)
		outs := make([]int, turns)
		total := sys
		for t := range turns {
			ins[t], outs[t] = sh.draw(rng, sh.inMin, sh.inMax), sh.draw(rng, sh.outMin, sh.outMax)
			total += ins[t] + outs[t]
		}
		all := randomTokens(rng, total)
		end := sys
		var base *prompt
		var prev *request
		for t := range turns {
			end += ins[t]
			p := &prompt{id: len(reqs) * 2, tokens: all[:end], base: base}
			a := &prompt{id: len(reqs)*2 + 1, tokens: all[:end+outs[t]], base: p}
			r := &request{
				id: len(reqs), name: fmt.Sprintf("%s-%d-c%d-t%d", name, seed, c, t), prefix: p,
				turn: t, answer: a, decodeTime: float64(outs[t]*max(sh.scale, 1)) * sh.decodePerToken,
				gap: sh.gapMin + rng.Float64()*(sh.gapMax-sh.gapMin),
			}
			if prev != nil {
				prev.next = r
				r.chained = true
			}
			reqs = append(reqs, r)
			prev = r
			end += outs[t]
			base = a
		}
		first := reqs[len(reqs)-turns]
		switch {
		case sh.active > 0 && c >= sh.active:
			// This conversation starts when an earlier one ends.
			lasts[c-sh.active].next = first
			first.chained = true
		default:
			first.arrival = rng.Float64() * sh.start
		}
		lasts = append(lasts, prev)
	}
	return reqs
}
