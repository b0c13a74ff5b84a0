//go:build !cgo

package zmq

// Without cgo this package has nothing but this line, so that a build with
// CGO_ENABLED=0 fails here with a sentence instead of with "undefined:
// State" from inside pebbe/zmq4: events/zmq speaks ZMQ through libzmq.
// Build with CGO_ENABLED=1 and libzmq3-dev installed (make deps), or feed
// package events from a transport of your own (events/natsstream is pure Go).
var _ = events_zmq_needs_cgo_and_libzmq__build_with_CGO_ENABLED_1_and_libzmq3_dev_or_feed_package_events_from_another_transport
