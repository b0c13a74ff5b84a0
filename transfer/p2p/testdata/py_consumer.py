#!/usr/bin/python3
"""A consumer of vLLM's P2P control protocol written from the spec alone,
with pyzmq and msgpack-python, to check the Go producer against an
independent implementation.

Usage: py_consumer.py PRODUCER_ADDR AGENT_MD_HEX BASE_ADDR NUM_BLOCKS BLOCK_LEN HASH_SEED KEY_HEX...

It binds a ROUTER on 127.0.0.1, dials the producer with a DEALER whose
identity is its own "host:port", runs the handshake both ways, looks up the
keys, fetches every hit into destination blocks 0, 1, ... , aborts an unknown
round, ends the request with an empty fetch and disconnects. It prints one
JSON object with what it received.
"""
import json
import sys

import msgpack
import zmq

TIMEOUT_MS = 5000


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
        return frames[0].decode(), msgpack.unpackb(frames[1], raw=False)

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

    send({"type": "lookup", "kv_request_id": "py-1", "keys": keys, "round_seq": 0})
    _, resp = recv()
    out["lookup_resp"] = {"type": resp["type"], "kv_request_id": resp["kv_request_id"],
                          "keys": [k.hex() for k in resp["keys"]], "hits": resp["hits"]}
    hits = [k for k, h in zip(resp["keys"], resp["hits"]) if h]
    send({"type": "fetch", "kv_request_id": "py-1", "keys": hits,
          "block_indexes": list(range(len(hits))), "round_seq": 0})
    _, done = recv()
    out["transfer_done"] = done

    # A fetch of a key that was no hit in its round fails at once.
    send({"type": "lookup", "kv_request_id": "py-1", "keys": keys[-1:], "round_seq": 1})
    recv()
    send({"type": "fetch", "kv_request_id": "py-1", "keys": keys[:1], "block_indexes": [0], "round_seq": 1})
    _, failed = recv()
    out["unpinned_fetch"] = failed

    send({"type": "abort_fetch", "kv_request_id": "py-unknown", "round_seq": 7})
    _, ack = recv()
    out["abort_ack"] = ack

    send({"type": "fetch", "kv_request_id": "py-1", "keys": [], "block_indexes": [], "round_seq": 2})
    send({"type": "disconnect"})
    print(json.dumps(out, sort_keys=True))
    dealer.close()
    router.close()
    ctx.term()


if __name__ == "__main__":
    main()
