//go:build !cgo

package p2p

// Without cgo this package has nothing but this line, so that a build with
// CGO_ENABLED=0 fails here with a sentence instead of with "undefined:
// State" from inside pebbe/zmq4: vLLM's P2P protocol runs over libzmq.
// Build with CGO_ENABLED=1 and libzmq3-dev installed (make deps), or use
// package transfer's interface with transfer/fake.
var _ = transfer_p2p_needs_cgo_and_libzmq__build_with_CGO_ENABLED_1_and_libzmq3_dev_or_use_transfer_fake
