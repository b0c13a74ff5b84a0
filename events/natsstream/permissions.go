package natsstream

// Role is what a NATS user of a fleet does, for Permissions.
type Role int

const (
	// RoleRelay publishes batches, holds the relay lease and writes the
	// sources table.
	RoleRelay Role = iota + 1
	// RoleReplica consumes the stream, loads snapshots, watches the
	// sources table and the relay lease, and shares in-flight pulls:
	// it publishes nothing that other replicas apply.
	RoleReplica
	// RoleSnapshotter is a replica that also stores snapshots
	// (ReplicaConfig.SnapshotInterval) and so purges the stream's
	// messages they cover.
	RoleSnapshotter
)

// Permissions are the subjects a NATS user may publish and subscribe
// to, as a server's authorization lists them (permissions: {publish:
// {allow: [...]}, subscribe: {allow: [...]}}); everything else is denied.
type Permissions struct {
	Publish, Subscribe []string
}

// Permissions returns what a fleet member of role needs under c, and
// nothing more: only relays publish on the event subjects, the relay
// lease and the sources table, and only they may create or update the
// stream and those buckets, so that a replica's credentials cannot put
// holders or sources in front of the others (replicas set Config.Bind).
// The JetStream API is assumed at its default prefix ($JS.API, no
// domain); replies come on _INBOX.
func (c Config) Permissions(role Role) Permissions {
	c = c.WithDefaults()
	api := "$JS.API."
	events, relayKV, sourcesKV := c.Stream, "KV_"+c.Stream+"_RELAY", "KV_"+c.Stream+"_SOURCES"
	pullsKV, leaseKV, snaps := "KV_"+c.Stream+"_PULLS", "KV_"+c.Stream+"_SNAPLEASE", "OBJ_"+c.Stream+"_SNAPSHOTS"
	p := Permissions{Publish: []string{api + "INFO"}, Subscribe: []string{"_INBOX.>"}}
	manage := func(streams ...string) {
		for _, s := range streams {
			p.Publish = append(p.Publish, api+"STREAM.CREATE."+s, api+"STREAM.UPDATE."+s, api+"STREAM.INFO."+s)
		}
	}
	info := func(streams ...string) {
		for _, s := range streams {
			p.Publish = append(p.Publish, api+"STREAM.INFO."+s)
		}
	}
	get := func(streams ...string) {
		for _, s := range streams {
			p.Publish = append(p.Publish, api+"STREAM.MSG.GET."+s, api+"DIRECT.GET."+s, api+"DIRECT.GET."+s+".>")
		}
	}
	consume := func(streams ...string) {
		for _, s := range streams {
			p.Publish = append(p.Publish, api+"CONSUMER.CREATE."+s, api+"CONSUMER.CREATE."+s+".>",
				api+"CONSUMER.INFO."+s+".>", api+"CONSUMER.DELETE."+s+".>", api+"CONSUMER.MSG.NEXT."+s+".>",
				"$JS.FC."+s+".>")
		}
	}
	switch role {
	case RoleRelay:
		manage(events, relayKV, sourcesKV)
		get(events, relayKV)
		p.Publish = append(p.Publish, c.SubjectPrefix+".>", "$KV."+c.Stream+"_RELAY.>", "$KV."+c.Stream+"_SOURCES.>")
	case RoleReplica, RoleSnapshotter:
		info(events, relayKV, sourcesKV)
		manage(pullsKV)
		get(snaps, relayKV, sourcesKV)
		consume(events, relayKV, sourcesKV, pullsKV, snaps)
		p.Publish = append(p.Publish, "$KV."+c.Stream+"_PULLS.>")
		if role == RoleReplica {
			// Whoever may update the snapshot store may give it a
			// max_age and so delete every snapshot.
			info(snaps)
		}
		if role == RoleSnapshotter {
			manage(leaseKV, snaps)
			get(leaseKV)
			p.Publish = append(p.Publish, api+"STREAM.PURGE."+events, api+"STREAM.PURGE."+snaps,
				"$O."+c.Stream+"_SNAPSHOTS.>", "$KV."+c.Stream+"_SNAPLEASE.>")
		}
	}
	return p
}
