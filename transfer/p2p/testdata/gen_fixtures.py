#!/usr/bin/python3
"""Writes the msgpack fixtures of vLLM's P2P control messages.

Run with /usr/bin/python3 (msgpack-python) from this directory:
    /usr/bin/python3 gen_fixtures.py

Encoded independently of the Go code, from the field table of
shared/spec/vllm-p2p.md. msgpack-python with use_bin_type=True writes what
vLLM's msgspec writes for these types: str as str, bytes as bin, ints in
their smallest form, bools as bools. Dicts keep insertion order.

encode_*.msgpack: the Go encoder must produce these bytes exactly: keys in
the Go encoder's fixed order ("type", then the spec table's order).
decode_*.msgpack: shapes only a peer produces (other key orders, no
round_seq, wide ints, extra keys); the Go decoder must accept them.
"""
import msgpack

KEY_A = bytes(range(32)) + (0).to_bytes(4, "big")   # 32-byte sha256 digest, group 0
KEY_B = bytes([0xFF] * 32) + (1).to_bytes(4, "big")  # group 1

encode = {
    "connect": {
        "type": "connect",
        "peer_id": "127.0.0.1:5710",
        "agent_metadata": b"kvsource-inproc/agent-1",
        "base_addr": 0x7F0000001000,
        "num_blocks": 300,
        "block_len": 65536,
        "config_fingerprint": "",
        "hash_seed": "vllm-none-hash",
    },
    "connect_ack": {"type": "connect_ack", "peer_id": "10.0.0.2:5711"},
    "lookup": {"type": "lookup", "kv_request_id": "req-1", "keys": [KEY_A, KEY_B], "round_seq": 0},
    "lookup_resp": {"type": "lookup_resp", "kv_request_id": "req-1", "keys": [KEY_A, KEY_B], "hits": [True, False]},
    "fetch": {"type": "fetch", "kv_request_id": "req-1", "keys": [KEY_A], "block_indexes": [200], "round_seq": 3},
    "fetch_empty": {"type": "fetch", "kv_request_id": "req-1", "keys": [], "block_indexes": [], "round_seq": 1},
    "transfer_done": {"type": "transfer_done", "kv_request_id": "req-1", "success": True, "round_seq": 3},
    "transfer_done_failed": {"type": "transfer_done", "kv_request_id": "req-1", "success": False, "round_seq": 128},
    "abort_fetch": {"type": "abort_fetch", "kv_request_id": "req-1", "round_seq": 70000},
    "abort_ack": {"type": "abort_ack", "kv_request_id": "req-1", "round_seq": 70000},
    "disconnect": {"type": "disconnect"},
}

decode = {
    # Keys in another order, a 64-bit base address, a non-empty fingerprint.
    "connect_reordered": {
        "hash_seed": "42",
        "block_len": 131072,
        "num_blocks": 1,
        "base_addr": 0xFFFFFFFFFFFF0000,
        "agent_metadata": b"\x00\x01md",
        "config_fingerprint": "0123456789abcdef",
        "peer_id": "pod-b:5710",
        "type": "connect",
    },
    # A pre-round (da3a252fd1) peer: no round_seq.
    "transfer_done_no_round": {"type": "transfer_done", "kv_request_id": "r", "success": False},
    # A later peer: extra keys are ignored.
    "abort_ack_extra": {"type": "abort_ack", "kv_request_id": "r", "round_seq": 2, "wire_major": 1, "source_epoch": b"\x00" * 16},
}

for name, msg in list(encode.items()) + list(decode.items()):
    prefix = "encode_" if name in encode else "decode_"
    with open(prefix + name + ".msgpack", "wb") as f:
        f.write(msgpack.packb(msg, use_bin_type=True))
