package natsstream

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// lease is a JetStream key-value lease: one key in a bucket whose TTL is
// the lease's, created by whoever takes the lease (Create fails while the
// key exists) and renewed by its holder with a revision compare-and-swap
// (Update fails once another took it). A holder that cannot renew for half
// the TTL stops acting on it before the key can expire and another take
// over, so two holders never overlap as long as clocks run at about the
// same rate.
type lease struct {
	kv         jetstream.KeyValue
	key, owner string
	ttl        time.Duration
	log        *slog.Logger

	rev     uint64
	renewed atomic.Int64  // unix ns of the last successful create or update; 0 when not held
	terms   atomic.Uint64 // counts the times the lease was taken
}

// term returns how many times the lease was taken: work tied to holding it
// (a relay's reconciliation) is redone when it changes, however briefly
// the lease was lost in between.
func (l *lease) term() uint64 { return l.terms.Load() }

// held reports whether the lease is ours and was renewed recently enough.
func (l *lease) held() bool {
	t := l.renewed.Load()
	return t != 0 && time.Since(time.Unix(0, t)) < l.ttl/2
}

// run takes and renews the lease until ctx is done, then releases it so a
// standby takes over at once rather than after the TTL.
func (l *lease) run(ctx context.Context) {
	tick := time.NewTicker(l.ttl / 4)
	defer tick.Stop()
	for {
		l.step(ctx)
		select {
		case <-ctx.Done():
			if l.rev != 0 {
				rctx, cancel := context.WithTimeout(context.Background(), time.Second)
				_ = l.kv.Delete(rctx, l.key, jetstream.LastRevision(l.rev))
				cancel()
				l.rev = 0
				l.renewed.Store(0)
			}
			return
		case <-tick.C:
		}
	}
}

func (l *lease) step(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, l.ttl/4)
	defer cancel()
	if l.rev != 0 {
		// Ours when last heard of: renew, even after a failed renewal made
		// held() false, since nobody else can have taken it before it
		// expires.
		rev, err := l.kv.Update(ctx, l.key, []byte(l.owner), l.rev)
		if errors.Is(err, jetstream.ErrKeyExists) {
			// An update that timed out here may have applied there.
			if e, gerr := l.kv.Get(ctx, l.key); gerr == nil && string(e.Value()) == l.owner {
				rev, err = e.Revision(), nil
			}
		}
		switch {
		case err == nil:
			l.rev = rev
			l.acquired()
		case errors.Is(err, jetstream.ErrKeyExists), errors.Is(err, jetstream.ErrKeyNotFound):
			l.log.Warn("natsstream: lease lost", "lease", l.key, "owner", l.owner, "err", err)
			l.rev = 0
			l.renewed.Store(0)
		case !l.held():
			l.renewed.Store(0)
		}
		return
	}
	rev, err := l.kv.Create(ctx, l.key, []byte(l.owner))
	if err != nil {
		return
	}
	l.rev = rev
	l.acquired()
	l.log.Info("natsstream: lease taken", "lease", l.key, "owner", l.owner)
}

// acquired records a successful create or renewal; it starts a new term
// when the lease was not held a moment ago: never renewed, or last renewed
// longer ago than held accepts (a failed renewal in between), since what
// was tapped meanwhile was kept, not published, and a new term reconciles
// it.
func (l *lease) acquired() {
	now := time.Now().UnixNano()
	if old := l.renewed.Swap(now); old == 0 || time.Duration(now-old) >= l.ttl/2 {
		l.terms.Add(1)
	}
}

// defaultName is name, or when it is empty the host name and process id.
func defaultName(name string) string {
	if name != "" {
		return name
	}
	host, _ := os.Hostname()
	return host + "-" + strconv.Itoa(os.Getpid())
}

// OwnerName is a fleet member's name that no other process shares: name,
// or when it is empty the host name and process id, with a random suffix.
func OwnerName(name string) string { return uniqueOwner(defaultName(name)) }

// uniqueOwner makes a lease owner of name that no other process shares,
// so that a restarted process with the same name does not take its
// predecessor's lease for its own.
func uniqueOwner(name string) string { return name + "/" + randomSuffix() }

// randomSuffix is 8 random hex digits.
func randomSuffix() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
