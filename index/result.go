package index

// TierPrefix is the longest consecutive prefix, in blocks, that a holder has
// in one tier.
type TierPrefix struct {
	Tier   string
	Blocks int
}

// Hit is one holder's answer to a lookup.
type Hit struct {
	Holder Holder
	// Prefix is the longest consecutive prefix of the looked-up keys held in
	// any tier (block i counts when some tier holds it).
	Prefix int
	// Tiers holds, for each tier with a non-empty prefix, the longest
	// consecutive prefix held in that tier alone.
	Tiers []TierPrefix
}

// Tier returns the holder's consecutive prefix in tier t, 0 when none.
func (h *Hit) Tier(t string) int {
	for _, tp := range h.Tiers {
		if tp.Tier == t {
			return tp.Blocks
		}
	}
	return 0
}

// Result holds a lookup's hits. Reuse one Result across lookups: its slices
// are recycled, so a steady-state lookup does not allocate.
type Result struct {
	Hits []Hit
	sc   scan
}

// Holder returns the hit of h, or nil when h holds no prefix.
func (r *Result) Holder(h Holder) *Hit {
	for i := range r.Hits {
		if r.Hits[i].Holder == h {
			return &r.Hits[i]
		}
	}
	return nil
}
