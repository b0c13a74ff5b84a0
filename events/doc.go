// Package events turns vLLM's KV-cache events (and SGLang's and
// TensorRT-LLM's, which share their wire form) into index updates, losing
// nothing it could have known and saying loudly when it cannot trust its
// state. It is pure Go and knows no transport: package events/zmq receives
// vLLM's ZMQ stream and drives it, and any other transport (NATS JetStream,
// a file replay, a pure-Go ZMQ, an EPP plugin's own feed) can do the same.
//
// # Decoding
//
// vLLM publishes one message per scheduler step, [topic, seq, payload],
// where payload is a msgpack EventBatch. Decoder reads every layout vLLM has
// used (tagged positional arrays of each field generation, tagged maps with
// omitted defaults and unknown fields), integer or raw-digest block hashes,
// with or without a data-parallel rank, the batch itself as an array or, as
// vLLM's main branch encodes it, a map by field name. A malformed payload is an error
// wrapping ErrMalformed, never a panic; an event of unknown type is skipped
// and the rest of its batch applies. The decoder reads the payload in
// place with the module's internal msgpack reader (shared with
// transfer/p2p), integer arrays (token ids, block hashes) in tight loops:
// with vmihailenco/msgpack's per-value calls one core decoded about 2.3M
// blocks/s, in place it decodes over 5M on a loaded machine.
// AppendBatch encodes a Batch in either layout, for publishers in tests,
// examples and demos.
//
// # Processing
//
// A Processor applies the messages a transport hands it to a Sink, normally
// an *index.Index:
//
//	proc, err := events.NewProcessor(events.Config{Sink: ix})
//	err = proc.Start(ctx)        // ctx bounds every replay
//	proc.Handle(ctx, events.Message{Pod: pod, Model: model, Seq: seq, Payload: payload, Replay: r})
//	err = proc.WaitApplied(ctx, index.Holder{Pod: pod}, seq) // or proc.Sync(ctx)
//	proc.Close()
//
// A holder is a (pod, data-parallel rank) pair. All messages of a pod go to
// one of Config.Workers workers, so each holder's events apply in order;
// one pod's messages must be handed in order. Message.Replay, an
// implementation of Replayer, fetches a holder's earlier batches to close a
// gap (vLLM's ROUTER replay socket, a JetStream stream read from a
// sequence); nil when the pod has none. A replay runs on a goroutine of its
// own: the pod's later messages wait behind it, other pods' do not, and it
// returns as soon as Start's ctx is done. Config.MaxHolders bounds the
// holders peers can make the processor track (a topic names any pod and a
// payload any rank). WaitApplied waits for a holder to apply a sequence
// number, Sync for everything handed so far, so that callers (tests,
// replays of recorded traffic, a router checking its index) wait for a
// condition instead of sleeping.
//
// Sequence numbers are tracked per holder:
//   - A jump forward is a gap. When the pod has a replay endpoint the missed
//     batches are fetched and applied in order, up to the batch that showed
//     the gap; Config.ReplayDeadline bounds the whole replay, since the
//     pod's later events wait for it. vLLM's replay socket drops replies a
//     slower reader cannot take in time, leaving holes the engine still
//     buffers: the replay then asks again from the first missing batch, up
//     to Config.ReplayRounds rounds (Stats.ReplayRounds, ReplayRecovered).
//   - A gap replay cannot close (no endpoint, timeout, range no longer
//     buffered) is handled by Config.Gap. The default, GapClear, clears the
//     holder's entries: from then on the index holds a subset of the
//     engine's blocks, which can cost a hit but never sends a pull for a
//     block that is gone. GapKeep keeps them and reports the holder "stale".
//   - A sequence number that goes backwards is an engine restart: the holder
//     is cleared, the new process's earlier batches are fetched from replay
//     when possible (a reconnecting subscriber misses the first ones), then
//     the batch applies. (A restarted engine whose first
//     batches are all lost until its numbers pass the old ones looks like a
//     gap, which GapClear also clears; one that resumes exactly at the
//     expected number cannot be told from the old process.)
//   - A holder seen for the first time starts wherever it joins (its empty
//     view is a subset of the engine's); earlier batches are fetched from
//     replay when possible. A replay that stops part-way leaves a gap
//     before the first batch, which the gap policy handles. Config.InitialSeqs instead resumes a router
//     restored from an index snapshot, treating what it missed as a gap.
//   - A full worker queue does not block Handle for longer than
//     Config.EnqueueTimeout: the message is dropped, counted, and its pod is
//     resynchronised from replay (or marked stale until the gap shows). So
//     are messages past Config.QueueLen waiting behind a pod's replay.
//
// Every case is counted in Stats and in each holder's HolderStatus.
//
// What each sequence number means is decided in one place, decide, a pure
// function of the holder's stream state and the message (sequence.go):
// join, apply, heartbeat, restart, gap, duplicate or backwards. Both the
// worker applying the message and its check whether the message starts a
// replay, which then runs off the worker, read it.
//
// # Writing a transport
//
// A transport receives (topic or pod, sequence number, payload) triples,
// maps each to a pod and model (ParseTopic is llm-d's "kv@<pod>@<model>"
// convention), and calls Handle from one goroutine per pod at a time; what
// it cannot read it reports with BadMessage. Its replay, if any, implements
// Replayer: stream the buffered batches from a sequence number, stop when
// fn returns false, honour ctx, and wrap ErrReplayTimeout when the source
// goes quiet. It calls Start before the first Handle and Close after the
// last.
//
// # Threat model
//
// vLLM's publisher has no authentication (no CURVE): whoever reaches a
// router's events port can publish under any pod name, and a pod name ends
// up in the index and in the pull header a destination engine dials. What
// the router can check, it checks:
//   - Pod names (ValidPodName): host:port, [v6]:port or dns-name:port (a bare
//     host for pods named by configuration), printable ASCII, at most 253
//     bytes; anything else is dropped before the index (Stats.BadTopic), so
//     no CR/LF or oversize name reaches a header. A name a resolver reads as
//     an address is one: IPv4 only in dotted decimal (inet_aton's other
//     spellings, "127.0.0.05", "0x7f.0.0.5", "127.5", "2130706437", and
//     any name whose last label is a number, are refused), IPv6 bracketed
//     without a zone, so no spelling of an address escapes the sender's IP
//     check as a DNS name.
//   - Senders, in bind mode (package events/zmq): a pod named by an IP
//     literal is accepted only from that IP (libzmq's "Peer-Address"), a pod
//     named by a DNS name only from allowed networks (zmq.SubscriberConfig.
//     Allow, default loopback; NoSenderCheck turns both checks off), and
//     one sender names at most MaxPodsPerSender pods (Stats.SenderMismatch),
//     pods forgotten no longer counting. So a spoofer cannot restart (empty
//     batch at seq 0), gap-clear (seq+1000) or feed a pod named by another
//     address, nor inject a holder under a DNS name from outside the
//     allowed networks. In connect mode the router dialled the pod's
//     address itself.
//   - Holder state is bounded, per sender and in all. One sender's
//     messages make at most Config.MaxHoldersPerSender holders (pod x
//     data-parallel rank, the rank being the payload's: one name can carry
//     any number; Stats.SenderHolders). At Config.MaxHolders a holder is
//     evicted rather than a new one refused: one of a sender holding more
//     than its share (MaxHolders over the senders) first, then one not
//     live, then the least recently heard, so a flood from a few hosts
//     evicts its own holders and not an idle healthy engine. Holders
//     restored from a snapshot that never publish expire
//     (Config.SnapshotExpiry), so made-up names neither lock real pods out
//     nor survive restarts. A flood from more hosts than MaxHolders holds
//     over the per-sender bound can still evict real holders: allow only
//     the engines' networks. A holder's entries are kept under the one
//     model its stream follows: a message under another model is a new
//     engine process on the address (an engine serves one model), which
//     clears the holder in every model and starts its stream again, as a
//     restart does; a holder a snapshot brought in keeps, at its first
//     message, only the snapshot's entries under the model it publishes
//     (HolderPruner). So the models a sender fills are bounded by its
//     holders, and a pod IP reused by another deployment is no source for
//     the dead engine's model.
//   - Per-pod state (sequence tracking, connection state, the bind socket's
//     address table) is bounded by the holders that exist, not by history:
//     a pod is forgotten with its last holder, so disconnects are tracked
//     exactly for every pod that holds blocks however many came and went.
//   - Two interleaved sequence streams under one holder put it in state
//     conflict (cleared once, messages dropped, no pull source) instead of
//     clearing it on every message.
//   - Logs are bounded: every line naming a pod is rate-limited per pod,
//     and every kind of line to Config.LogBudget lines a second across all
//     pods (default 10), the next line saying how many were left out
//     (left_out), since the pods are the peer's to make up.
//   - Only live holders serve pulls (Processor.Source, for
//     picker.Config.Sources): heard from since this process started, their
//     connection up (a transport's PodConnected: the ZMQ socket monitor and
//     heartbeats, zmq.SubscriberConfig.Heartbeat), a message applied since
//     the connection last came up (StateReconnected until then: a new
//     engine process on a dead one's address has an empty cache, and its
//     first message's sequence number shows the restart, which clears the
//     holder in every model), entries trusted, not in conflict. A snapshot
//     lets a holder score, never serve. An empty batch numbered 0 that
//     repeats an applied 0 on a connection that came up since is a
//     restart, not a heartbeat: a new vLLM or SGLang process numbers from
//     0, so it is as likely the new process's first batch.
//
// What it cannot check: a peer that can send from a pod's own IP (same host,
// or a spoofed source on a network without ingress filtering, which TCP's
// handshake makes impractical beyond one hop) is that pod: its empty batch at
// seq 0 is a genuine restart. On a bind socket, libzmq names a message's
// sender address, not its connection: when one of several connections from
// an address closes (one of a host's engines died), every pod of that
// address is disconnected until its next message, since which one died is
// unknown; connect mode follows each engine exactly. A DNS-named pod
// can be impersonated from inside an allowed network: name pods by IP, or
// allow only the pods' own network. Payload contents (which blocks a pod
// claims) are the engine's word; a lying engine costs its own requests a
// failed pull, which falls back to compute.
//
// # The CPU offload tier
//
// vLLM's offloading connector reports its tier with BlockStored events of
// medium "CPU", keyed by offload keys, one per offloaded chunk of k GPU
// blocks (k = the connector's block_size / the GPU block size): a chunk's
// key is the hash of its last GPU block. The index stores each key as one
// block, so:
//   - k = 1, vLLM's default, is exact: the tier's keys are the GPU blocks'.
//   - k > 1 shows only every k-th block of the tier, and the tier's prefix
//     and pull gains undercount. An offload-tier event whose non-zero block
//     size differs from the holder's GPU-tier events' (or, before any, from
//     Config.Hasher's or Config.ContentKeys' block size) is applied as
//     usual, counted in Stats.ChunkedOffload and HolderStatus.ChunkedOffload,
//     and logged as a warning once per holder and MismatchLogInterval. Fix
//     it by configuring the connector's block_size equal to the GPU's.
//   - Newer connectors send block size 0 (no tokens, no parent): such
//     events do not say their chunk size and are taken as k = 1.
//
// # Other engines
//
// SGLang's and TensorRT-LLM's publishers send vLLM's wire form with their
// own habits, which Decoder and the Processor read whatever engine a pod
// runs: block hashes and parents as signed int64 (a negative one is its
// two's-complement bit pattern, as Dynamo's decoder reads it); SGLang's
// BlockStoredWithMetadata (Event.CacheSalt), its EAGLE token pairs
// (Event.Bigram) and its host tier CPU_PINNED as the CPU tier;
// TensorRT-LLM's v2_sha256 hashes as hex strings (keyed by their first 8
// bytes, the same key as its v2_sha256_64); sequence numbers that start
// far from 0 (TensorRT-LLM's time.time_ns()), which is where a holder
// joins; and empty heartbeat batches, which are liveness even when they
// repeat the last number (Stats.Heartbeats), except 0 repeating 0 after a
// reconnect (see the threat model). What the payloads do not show
// is the pod's Engine (Message.Engine, zmq.PodConfig.Engine): an
// EngineTRTLLM pod's jump forward by TRTRestartJump or more is a restart,
// since its numbers restart at the new process's time_ns. Their keys are
// reproducible (package hashing's EngineAlgos; Engine.Hashing gives each
// engine's defaults), and a hash mismatch's diagnosis names the engine
// whose keys a stream carries. In content-key mode an EAGLE page is keyed
// by its positions' own tokens, so a prompt that ends exactly at a page
// may score one page more than SGLang reuses; TensorRT-LLM's events do
// not carry the cache salt its keys mix in, so salted block-0 events fail
// the agreement check.
//
// # Trust: engine keys or content keys
//
// By default the index is keyed by the engines' own block hashes, and the
// router hashes prompts with package hashing configured like the engines
// (algorithm, PYTHONHASHSEED, block size). Config.Hasher enables the hash
// agreement check: each BlockStored that starts at block 0 with token ids
// is rehashed and compared, a mismatch is counted per holder and logged
// once per holder and interval with its likely cause (hashing.Diagnose:
// the algorithm, seed or block size that reproduces the engine's keys, or
// none, pointing at a random seed or at keys that are not vLLM's, whose
// remedy Config.ContentKeysHint names). A parent hash of 0, which llm-d's
// producers send for a chain's first block, reads as no parent
// (Stats.ZeroParents), so their events are checked too. Choose this mode
// whenever the engines' settings are known and reproducible: keys need no
// translation and every event, including token-less ones, applies.
//
// Content-key mode (Config.ContentKeys, a hashing.Content hasher) is for
// engines whose hashes a router cannot reproduce: xxhash with a random
// seed, another engine, a future vLLM change. Index keys are computed from
// each event's token ids with the same chained content hash the request
// side then uses, and a bounded per-holder map from engine keys to content
// keys resolves later BlockRemoved events and token-less CPU-tier events.
// It costs a hash per stored block and needs events with token ids; blocks
// it cannot resolve are counted (Stats.Unresolved) and left out, so the
// index again holds a subset of the engine's blocks.
//
// # Files
//
//   - decode.go, encode.go, extra.go, opt.go: the wire form, read in place
//     and written for tests and demos; engine.go: each engine's habits.
//   - processor.go: Config, Message, the Processor's API, Stats and
//     HolderStatus; counters.go: every counter, defined once.
//   - worker.go: a worker's loop: each pod's messages in order, a replay
//     run off the worker with the pod's later messages queued behind it,
//     messages dropped on a full queue turned into resyncs.
//   - holder.go: holders made (within the bounds), evicted and expired,
//     and a holder publishing another model.
//   - sequence.go: decide, the sequence state machine, pure.
//   - stream.go: what a holder's stream does with decide's answer: catch
//     up, close a gap, restart, enter and leave conflict, the gap policy.
//   - replay.go: replay rounds, and resyncs after dropped messages.
//   - apply.go: a batch's events to the Sink, in runs of one index call;
//     checks.go: the hash agreement and chunked-offload checks;
//     content.go: content-key mode.
//   - liveness.go: holder states, pod connections, sender bounds and
//     eviction; logs.go: the rate-limited log lines; podname.go: pod
//     names; sink.go: the Sink interfaces.
package events
