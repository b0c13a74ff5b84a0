#!/usr/bin/python3
"""A consumer of vLLM's P2P control protocol written from the spec alone,
with pyzmq and msgpack-python, to check the Go producer against an
independent implementation.

Usage: py_consumer.py PRODUCER_ADDR AGENT_MD_HEX BASE_ADDR NUM_BLOCKS BLOCK_LEN HASH_SEED KEY_HEX...

It binds a ROUTER on 127.0.0.1, dials the producer with a DEALER whose
identity is its own "host:port", runs the handshake both ways, looks up the
keys, fetches every hit into destination blocks 0, 1, ... , loads the first
key again into the next block, fetches a miss, aborts an unknown round, ends
the request with an empty fetch and disconnects. It prints one JSON object
with what it received.

Rounds follow vLLM's consumer (session/client.py at ef47a897e2), not a
counter: a fetch closes its round and advances round_seq, but once no load is
in flight and no probe is open the request's state is dropped, so each load
of the request starts at round_seq 0 again, and so does the empty fetch
after an all-miss lookup.
"""
import json
import sys

import msgpack
import zmq

TIMEOUT_MS = 5000


class Rounds:
    """The round_seq of one request as vLLM's ClientRole keeps it: a fetch
    takes the current round and advances it; the request's state, round
    included, is dropped when no load is in flight and no probe is open."""

    def __init__(self):
        self.current = 0
        self.loads = 0
        self.probes = False

    def probe(self):
        self.probes = True
        return self.current

    def fetch(self):
        seq = self.current
        self.current += 1
        self.loads += 1
        self.probes = False
        return seq

    def done(self):
        self.loads -= 1
        self._prune()

    def finish(self):
        seq = self.current
        self.probes = False
        self._prune()
        return seq

    def _prune(self):
        if self.loads == 0 and not self.probes:
            self.current = 0


def main():
    addr, md_hex, base, nblocks, block_len, seed = sys.argv[1:7]
    keys = [bytes.fromhex(k) for k in sys.argv[7:]]
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    me = "127.0.0.1:%d" % port
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, me.encode())
    for opt, val in ((zmq.HEARTBEAT_IVL, 2000), (zmq.HEARTBEAT_TIMEOUT, 10000), (zmq.HEARTBEAT_TTL, 10000)):
        dealer.setsockopt(opt, val)
        router.setsockopt(opt, val)
    dealer.connect("tcp://" + addr)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)

    def send(msg):
        dealer.send(msgpack.packb(msg, use_bin_type=True))

    def recv():
        if not poller.poll(TIMEOUT_MS):
            raise SystemExit("timeout")
        frames = router.recv_multipart()
        if len(frames) != 2:
            raise SystemExit("expected 2 frames, got %d" % len(frames))
        msg = msgpack.unpackb(frames[1], raw=False)
        if msg["type"] == "disconnect":
            raise SystemExit("the producer sent disconnect")
        return frames[0].decode(), msg

    out = {"id": me}
    send({"type": "connect", "peer_id": me, "agent_metadata": bytes.fromhex(md_hex),
          "base_addr": int(base), "num_blocks": int(nblocks), "block_len": int(block_len),
          "config_fingerprint": "", "hash_seed": seed})
    got_ack = got_connect = False
    while not (got_ack and got_connect):
        sender, msg = recv()
        if msg["type"] == "connect":
            got_connect = True
            out["producer_id"] = sender
            out["producer_connect"] = {k: (v.hex() if isinstance(v, bytes) else v) for k, v in msg.items()}
            send({"type": "connect_ack", "peer_id": me})
        elif msg["type"] == "connect_ack":
            got_ack = True
            out["connect_ack_peer_id"] = msg["peer_id"]

    rounds = Rounds()

    def load(wanted, first_block):
        """One load of request py-1: lookup, then a fetch of the hits, as
        vLLM's consumer sends them. Returns the lookup_resp and the
        transfer_done (None without hits: nothing is fetched)."""
        send({"type": "lookup", "kv_request_id": "py-1", "keys": wanted, "round_seq": rounds.probe()})
        _, resp = recv()
        hits = [k for k, h in zip(resp["keys"], resp["hits"]) if h]
        if not hits:
            return resp, None
        send({"type": "fetch", "kv_request_id": "py-1", "keys": hits,
              "block_indexes": list(range(first_block, first_block + len(hits))), "round_seq": rounds.fetch()})
        _, done = recv()
        rounds.done()
        return resp, done

    resp, out["transfer_done"] = load(keys, 0)
    out["lookup_resp"] = {"type": resp["type"], "kv_request_id": resp["kv_request_id"],
                          "keys": [k.hex() for k in resp["keys"]], "hits": resp["hits"]}
    nhits = sum(resp["hits"])

    # The request's next load of the first key: round 0 again.
    _, out["second_load"] = load(keys[:1], nhits)

    # A fetch of a key that was no hit in a round that pinned one fails at
    # once. (vLLM's consumer itself fetches only hits.)
    send({"type": "lookup", "kv_request_id": "py-1", "keys": keys[:1] + keys[-1:], "round_seq": rounds.probe()})
    recv()
    send({"type": "fetch", "kv_request_id": "py-1", "keys": keys[-1:], "block_indexes": [0], "round_seq": rounds.fetch()})
    _, failed = recv()
    rounds.done()
    out["unpinned_fetch"] = failed

    send({"type": "abort_fetch", "kv_request_id": "py-unknown", "round_seq": 7})
    _, ack = recv()
    out["abort_ack"] = ack

    # An all-miss lookup opens a round no fetch closes: the request's end
    # is an empty fetch in that round.
    load(keys[-1:], 0)
    send({"type": "fetch", "kv_request_id": "py-1", "keys": [], "block_indexes": [], "round_seq": rounds.finish()})
    send({"type": "disconnect"})
    print(json.dumps(out, sort_keys=True))
    dealer.close()
    router.close()
    ctx.term()


if __name__ == "__main__":
    main()
