#!/usr/bin/python3
"""A producer of vLLM's P2P control protocol written from the spec alone,
with pyzmq and msgpack-python, to check the Go client against an
independent implementation. It moves no data: a fetch of hit keys is
answered with transfer_done success=true.

Usage: py_producer.py BLOCK_LEN HASH_SEED HELD_KEY_HEX...

Prints its "host:port" on the first line, serves one consumer until it
disconnects, then prints one JSON object listing what it received.
"""
import json
import sys

import msgpack
import zmq

TIMEOUT_MS = 10000


def main():
    block_len, seed = int(sys.argv[1]), sys.argv[2]
    held = {bytes.fromhex(k) for k in sys.argv[3:]}
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    # The identity differs from the address the client dials (127.0.0.1),
    # as a producer configured with a host name's would.
    me = "localhost:%d" % port
    print("127.0.0.1:%d" % port, flush=True)

    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    dealer = None
    acked = False
    queue = []
    pinned = {}  # (kv_request_id, round_seq) -> set of keys
    log = []

    def send(msg, force=False):
        data = msgpack.packb(msg, use_bin_type=True)
        if acked or force:
            dealer.send(data)
        else:
            queue.append(data)

    while True:
        if not poller.poll(TIMEOUT_MS):
            raise SystemExit("timeout")
        frames = router.recv_multipart()
        if len(frames) != 2:
            raise SystemExit("expected 2 frames, got %d" % len(frames))
        sender, msg = frames[0].decode(), msgpack.unpackb(frames[1], raw=False)
        entry = {"from": sender}
        for k, v in msg.items():
            if isinstance(v, bytes):
                v = v.hex()
            elif isinstance(v, list):
                v = [x.hex() if isinstance(x, bytes) else x for x in v]
            entry[k] = v
        log.append(entry)
        t = msg["type"]
        if t == "connect":
            host, p = msg["peer_id"].rsplit(":", 1)
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.IDENTITY, me.encode())
            dealer.connect("tcp://%s:%s" % (host, p))
            send({"type": "connect", "peer_id": me, "agent_metadata": b"py-agent", "base_addr": 1 << 44,
                  "num_blocks": 64, "block_len": block_len, "config_fingerprint": "", "hash_seed": seed}, force=True)
            if msg["block_len"] != block_len or msg["hash_seed"] != seed:
                continue  # rejection is silence
            send({"type": "connect_ack", "peer_id": me}, force=True)
        elif t == "connect_ack":
            acked = True
            for data in queue:
                dealer.send(data)
            queue.clear()
        elif t == "lookup":
            rk = (msg["kv_request_id"], msg.get("round_seq", 0))
            hits = [k in held for k in msg["keys"]]
            pinned.setdefault(rk, set()).update(k for k, h in zip(msg["keys"], hits) if h)
            send({"type": "lookup_resp", "kv_request_id": msg["kv_request_id"], "keys": msg["keys"], "hits": hits})
        elif t == "fetch":
            rk = (msg["kv_request_id"], msg.get("round_seq", 0))
            if not msg["keys"]:
                for k in [k for k in pinned if k[0] == rk[0]]:
                    del pinned[k]
                continue
            ok = all(k in pinned.get(rk, ()) for k in msg["keys"])
            pinned.pop(rk, None)
            send({"type": "transfer_done", "kv_request_id": rk[0], "success": ok, "round_seq": rk[1]})
        elif t == "abort_fetch":
            send({"type": "abort_ack", "kv_request_id": msg["kv_request_id"], "round_seq": msg.get("round_seq", 0)})
        elif t == "disconnect":
            break
    print(json.dumps(log), flush=True)
    dealer.close()
    router.close()
    ctx.term()


if __name__ == "__main__":
    main()
