package events

// seqState is what decide reads of a holder's stream.
type seqState struct {
	started bool   // next is known: the holder applied a batch, or InitialSeqs named one
	next    uint64 // the sequence number expected next
	liveMax uint64 // the highest sequence number received live
	hasSeq  bool   // next-1 was applied (or is InitialSeqs')
	trt     bool   // TensorRT-LLM: a new process numbers from its start's time_ns
}

// seqMsg is what decide reads of a message.
type seqMsg struct {
	seq   uint64
	empty bool // its batch has no events
	// tapped: it is another Processor's Tap batch (Config.Tapped), which
	// carries no heartbeats.
	tapped bool
	// reconnected: it was handed after its pod's latest reconnect, and
	// the holder has handled no message sent since.
	reconnected bool
}

// action is what a holder's stream does with a message.
type action uint8

const (
	// actJoin: the holder's first message, wherever it numbers: it
	// catches up on the batches before it from replay, then applies.
	actJoin action = iota
	// actApply: the number expected: it applies.
	actApply
	// actHeartbeat: an empty batch repeating the last applied number:
	// the same process is alive, nothing applies.
	actHeartbeat
	// actRestart: TensorRT-LLM's jump forward by TRTRestartJump or more,
	// a new process's time_ns: the holder is cleared, catches up on the
	// new process's batches before it, then applies.
	actRestart
	// actGap: a jump forward: replay fetches the batches missed and the
	// gap policy handles what it cannot; then it applies.
	actGap
	// actDuplicate: a number before the next but past the live maximum,
	// applied already from a replay that ran ahead of the live stream:
	// dropped.
	actDuplicate
	// actBackwards: a number applied already and received live before: a
	// restart, unless numbers went backwards often enough to be two
	// interleaved streams (a conflict).
	actBackwards
)

// decide is a holder's sequence state machine: what a holder whose stream
// is in state s does with message m. It is pure, so that the live path
// (step) and the prediction that runs a replay off the worker (replays)
// cannot disagree.
func decide(s seqState, m seqMsg) action {
	switch {
	case !s.started:
		return actJoin
	case m.seq == s.next:
		return actApply
	case heartbeat(s, m):
		return actHeartbeat
	case s.trt && m.seq > s.next && m.seq-s.next >= TRTRestartJump:
		return actRestart
	case m.seq > s.next:
		return actGap
	case m.seq > s.liveMax:
		return actDuplicate
	}
	return actBackwards
}

// heartbeat reports whether m, in state s, is an empty batch repeating the
// last applied number: a heartbeat of the same process, which must not
// read as a restart.
//
// Except 0 repeating 0 on a connection that came up since the holder last
// confirmed a message: vLLM and SGLang number a new process's batches
// from 0, so that is as likely a new process's first batch, an empty one,
// as its predecessor's heartbeat, and only the restart keeps the index a
// subset of the engine's blocks (a heartbeat would make the dead
// process's blocks a source again). TensorRT-LLM numbers from its start
// time, and no new process starts at a later number: those stay
// heartbeats. A Tap batch is never one: heartbeats never reach a Tap.
func heartbeat(s seqState, m seqMsg) bool {
	if m.tapped || !m.empty || !s.hasSeq || m.seq+1 != s.next {
		return false
	}
	return m.seq != 0 || !m.reconnected
}

// replays reports whether a holder taking action a on message seq fetches
// batches from replay, when it has a replay endpoint it may use now.
func (a action) replays(seq uint64) bool {
	switch a {
	case actGap:
		return true
	case actJoin, actRestart, actBackwards:
		// It catches up on the batches before seq: none come before 0.
		return seq != 0
	}
	return false
}
