// Package natsstream shares one KV-event stream among router replicas
// through NATS JetStream: relays append engines' batches to a stream,
// replicas consume it into their own in-memory index, a shared snapshot
// in the JetStream object store lets a new replica start warm, and a
// key-value bucket shares in-flight pulls so that replicas spread them
// fleet-wide; another carries the relay's holder states, so that replicas
// pull only from live holders.
//
//	engines --ZMQ--> relay(s) --> JetStream stream --> replicas (index, picker, HTTP)
//	                                   |  object store: snapshots
//	                                   |  KV: relay lease, snapshot lease, in-flight pulls, sources
//
// # Relay
//
// A relay is a zmq.Subscriber (bind or connect mode, gap repair from the
// engines' replay, restart detection) whose events.Config.Tap is Relay.Tap:
// every batch the subscriber applies, in the order it applies them, is
// stored on subject <prefix>.<model>.<pod> (EscapeToken makes names with
// ':', '.', '/' subject-safe) with headers Kvs-Model, Kvs-Pod, Kvs-Rank,
// Kvs-Seq and the engine's payload as it was received. Its Nats-Msg-Id is
// a hash of model, pod, rank, sequence number and payload: two relays of
// the same engines compute the same id for the same batch, and a
// restarted engine reusing a sequence number is not mistaken for its
// predecessor (its bytes, at least its timestamp, differ).
//
// Tap keeps the batch and returns: it never waits on the stream, so that
// one batch the stream refuses, or NATS being down, cannot hold the
// subscriber's worker and every pod on it. RelayConfig.Publishers
// goroutines publish, one batch at a time per subject, in order, each
// returning once the stream acknowledged it and retrying with the same id
// on failure; a retry whose first attempt had in fact been stored is
// dropped by the stream's duplicate window (Config.DuplicateWindow, two
// minutes by default: the assumption is that no retry comes later than
// that). What waits is bounded by RelayConfig.Retain and RetainN, and the
// attempts at one batch while connected by PublishAttempts: past them a
// batch is dropped and counted (RelayStats), a gap to the replicas, which
// clear the holder as a subscriber does for a gap it cannot repair.
// Relay.Healthy fails while the oldest waiting batch is older than the
// lease TTL.
//
// The server's limits are checked before publishing: a batch over its
// max_payload (its INFO announces it, 1 MiB by default, while an engine's
// batch can be up to events' 16 MiB) is published as consecutive parts
// with header Kvs-Part "i/n", which replicas join back into the batch
// (bounded by ReplicaConfig.MaxBatchBytes); a subject over its
// max_control_line (RelayConfig.MaxControlLine, 4096 bytes by default,
// which the server does not announce; the model and pod names make the
// subject) is dropped and counted, since the server closes a connection
// that sends one, and with it every other pod's publishes.
//
// # Ordering
//
// A consumer can rely on: each holder's (pod, rank) batches are in the
// stream in the order the relay's subscriber applied them, without
// duplicates, gaps being those the relay could not repair either. A
// replica hands the stream's batches, in order, to an events.Processor
// (the same sequencing a subscriber runs, without a replay endpoint), so
// it reaches the state the relay's own subscriber reached: gaps and
// restarts clear the holder alike. The replica's Processor is
// events.Config.Tapped, since it sees no connection events: the relay
// forwards no heartbeat, so a batch repeating the last applied number (a
// new engine's empty first batch at 0 after its predecessor's 0) is a
// restart there too. Across subjects, the stream's order is the order of
// arrival, which nothing should depend on. The stream carries the
// engines' payloads as they were received, so a fleet whose relays index
// content keys (events.Config.ContentKeys) needs replicas that apply it
// with the same hasher (ReplicaConfig.ContentKeys): without it a replica
// indexes the engines' own keys, which no content-keyed request matches.
//
// # Two relays
//
// Several relays may subscribe to the same engines; one holds the relay
// lease (a key in <Stream>_RELAY created with Create and renewed with a
// revision compare-and-swap, TTL RelayConfig.LeaseTTL) and publishes. The
// others keep every batch they tap for RelayConfig.Retain (longer than the
// TTL). On taking the lease, a relay reads each subject's last message and
// publishes what it kept after it (found by its message id, or else by
// sequence number), then goes on live; the duplicate window drops what
// the old holder stored of that, as it does when an old holder that lost
// the lease still had a publish in flight. A holder stops publishing once
// it has not renewed for half the TTL, before another can take over. What
// no relay stores is a gap, which replicas handle as the relays'
// subscribers would.
//
// # Replicas and snapshots
//
// Open builds a replica's index from its shard's newest snapshot (objects
// <Stream>_SNAPSHOTS/index-<shard>-a and -b, written alternately so that
// a snapshot being read is not the one being replaced; the metadata holds
// the stream sequence each covers) and Run consumes with an ordered consumer from the
// next sequence, filtered to ReplicaConfig.Models when it shards by model.
// With ReplicaConfig.SnapshotInterval set, replicas compete for the
// shard's snapshot lease; its holder stores a snapshot that often, then
// purges the shard's messages that the previous snapshot covered. The
// stream has no age or size limits: only these purges remove messages, so
// the newest snapshot plus the stream after it always hold the state, and
// a replica lagging by less than a snapshot interval still finds its next
// message. A fleet snapshots either per model shard or unsharded, not both:
// the unsharded holder's purges would remove sharded replicas' history.
//
// # The fleet's other buckets
//
// Package picker/natsfleet, next to the picker it serves, shares each
// replica's in-flight pulls in <Stream>_PULLS and the leading relay's
// holder states in <Stream>_SOURCES, named after this package's Config;
// a table names the relay lease's owner (Relay.Owner, RelayLeaseKey), and
// Permissions lists both buckets for the roles.
//
// # Security
//
// Whoever may publish on <prefix>.> puts holders and blocks in every
// replica's index, and whoever may write <Stream>_SOURCES and
// <Stream>_RELAY decides which holders replicas pull from: NATS's own
// security is what closes these doors. ConnConfig connects with a creds
// file, an nkey seed, a user and password or a token, and TLS with a CA
// and a client certificate; Config.Permissions lists, per Role, the
// subjects each user needs and nothing more. Relays (RoleRelay) publish
// batches, hold the relay lease, write the sources table and create the
// stream and their buckets. Replicas (RoleReplica) set Config.Bind and
// publish none of those: they consume, read snapshots and share
// in-flight pulls (<Stream>_PULLS); snapshotters (RoleSnapshotter) also
// create and update the snapshot store, store snapshots, hold the
// snapshot lease and purge the stream. A replica that stores no snapshots
// (ReplicaConfig.SnapshotInterval zero) opens the snapshot store as it is,
// never updating it, and starts cold while no snapshotter has created it.
//
// What a client with publish rights can still do:
//
//   - With a relay's rights (or any right to publish on <prefix>.>): put
//     batches under any pod name in front of every replica, so that they
//     route to pods it names; clear or reset real holders with
//     sequence numbers that jump or go back (replicas apply gaps and
//     restarts as a subscriber does); replay old batches with new bytes
//     (the duplicate window drops only identical message ids); fill the
//     stream, which has no limits of its own (an account's JetStream
//     limits bound it). It can also take or delete the relay lease and
//     write a table naming the lease's holder, whose name anyone who may
//     watch the lease reads: the owner check keeps out tables of a relay
//     that lost the lease and of writers that do not hold it, not a
//     forger with a relay's rights. A relay's credentials are as strong
//     as the relay.
//   - With a replica's rights: read everything on the stream (pod names,
//     block hashes) and add or remove in-flight pulls, making holders
//     look busier or idler to the other replicas' spreading for up to the
//     pulls' TTL (within natsfleet.PullsConfig.MaxRemote pulls, whose memory goes
//     with the TTL); not publish a batch, write a table or the lease,
//     create or change the stream or the relays' buckets, or change the
//     snapshot store (a max_age on it would delete every snapshot, and
//     the next replica could not start).
//   - With a snapshotter's rights, in addition: store a made-up snapshot,
//     from which new replicas start, and purge the stream, so that
//     replicas starting later miss what it held. Give RoleSnapshotter
//     only to the replicas that store snapshots.
//   - Without credentials, on the network: TLS keeps it from reading or
//     changing what relays, replicas and the server exchange.
package natsstream
