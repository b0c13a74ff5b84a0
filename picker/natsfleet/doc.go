// Package natsfleet shares what a picker needs to know of the rest of a
// fleet of router replicas through the key-value buckets of the fleet's
// NATS JetStream (package events/natsstream names them and creates the
// stream): the pulls each replica has in flight (Pulls, a picker.Fleet)
// and which holders the relay hears live (Sources, for
// picker.Config.Sources).
//
// # Fleet-wide spreading
//
// Pulls implements picker.Fleet: each pull a replica's picker directs is
// a key in <Stream>_PULLS (TTL the picker's in-flight TTL) until it is
// done, and every replica watches the bucket, so each one's in-flight
// counts include the others' pulls, a few milliseconds late. A replica
// counts at most PullsConfig.MaxRemote of the others' pulls, only those
// whose value names a holder (a pod name events.ValidPodName takes), and
// keeps nothing of one, its holder included, once it ends or its TTL
// passes (PullsStats.Malformed and OverCap count the others). Anyone with
// a replica's credentials can add or remove pulls (see natsstream's
// Security section): what Pulls logs of them is on a budget per kind of
// line.
//
// # Live sources
//
// Only the relay's subscriber sees the engines' connections, so only it
// knows which holders may serve a pull (events.Processor.Source). The
// leading relay writes every holder's state to <Stream>_SOURCES each
// SourcesConfig.Interval (Sources.Publish); replicas watch it and give
// Sources.Source to their pickers. A holder the table does not list, or
// every holder once no relay has written for SourcesConfig.TTL, is no
// source: a replica never pulls from a holder no relay vouches for. Each
// table names the relay lease's owner, and a replica takes only the
// table of the lease's current holder (natsstream.RelayLeaseKey of
// <Stream>_RELAY).
package natsfleet

import "errors"

// ErrConfig: a PullsConfig or SourcesConfig cannot work.
var ErrConfig = errors.New("natsfleet: bad config")

// truncate shortens s to at most n bytes for a log line.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
