package events

// Opt is a field a payload may leave out; the zero Opt is absent. Events
// hold their optional fields as Opt values rather than pointers or Has*
// flags, so that decoding into a reused Batch still allocates nothing.
type Opt[T any] struct {
	v  T
	ok bool
}

// Some returns a present Opt holding v.
func Some[T any](v T) Opt[T] { return Opt[T]{v: v, ok: true} }

// Get returns the value, and whether the payload had it.
func (o Opt[T]) Get() (T, bool) { return o.v, o.ok }

// Or returns the value, or def when it is absent.
func (o Opt[T]) Or(def T) T {
	if !o.ok {
		return def
	}
	return o.v
}
