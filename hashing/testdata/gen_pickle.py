#!/usr/bin/env python3
"""Generates pickle_vectors.json: CPython's protocol-5 pickle of the values
vLLM hashes, for the Go pickle encoder's tests. Run from this directory:

    python3 gen_pickle.py > pickle_vectors.json

Each case is {"name", "value", "len", "sha256"} and, for short pickles, "hex".
A value is {"str": s} (a seed) or {"parent": hex, "tokens": spec, "extra":
keys}: tokens spec is a list of ints, or {"n", "a", "b", "m"} meaning
[(a*i + b) % m for i in range(n)]; keys are null or a list whose elements are
a JSON string (str), a number (int), a list (tuple), {"hex": h} (bytes),
{"str_repeat": [s, n]} (s * n) or {"bytes_repeat": [h, n]}.
"""
import hashlib
import json
import pickle
import random
import sys


def tokens_of(spec):
    if isinstance(spec, list):
        return tuple(spec)
    return tuple((spec["a"] * i + spec["b"]) % spec["m"] for i in range(spec["n"]))


def key_of(k):
    if isinstance(k, list):
        return tuple(key_of(e) for e in k)
    if isinstance(k, dict):
        if "hex" in k:
            return bytes.fromhex(k["hex"])
        if "str_repeat" in k:
            s, n = k["str_repeat"]
            return s * n
        if "bytes_repeat" in k:
            h, n = k["bytes_repeat"]
            return bytes.fromhex(h) * n
    if isinstance(k, str):
        # A str made at run time, as vLLM's are (from a request's JSON), not
        # a constant of this script that the compiler may share.
        return json.loads(json.dumps(k))
    return k


def value_of(v):
    if "str" in v:
        return v["str"]
    extra = None if v["extra"] is None else tuple(key_of(k) for k in v["extra"])
    return (bytes.fromhex(v["parent"]), tokens_of(v["tokens"]), extra)


def main():
    rnd = random.Random(20261129)
    p32 = "ab" * 32
    p16 = "cd" * 16
    edges = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1]
    cases = []

    def add(name, value):
        cases.append({"name": name, "value": value})

    for s in ["", "0", "12345", "vllm-none-hash", "seed-with-üñî", "x" * 255, "x" * 256,
              "é" * 200]:
        add("seed/%d" % len(s), {"str": s})
    add("seed/str_repeat65535", {"str": "y" * 65535})
    add("seed/str_repeat65536", {"str": "y" * 65536})
    for n in range(1, 7):
        add("tuplelen/%d" % n, {"parent": p32, "tokens": edges[:n], "extra": None})
    add("edges/p32", {"parent": p32, "tokens": edges, "extra": None})
    add("edges/p16", {"parent": p16, "tokens": edges, "extra": None})
    ints = [0, 1, -1, 255, 256, -256, 65535, 65536, -65536, 2**31 - 1, -2**31, 2**31, -2**31 - 1,
            2**32, -2**32, 2**39 - 1, -2**39, 2**39, -2**39 - 1, 2**47, -2**55, 2**63 - 1, -2**63]
    add("extra/ints", {"parent": p32, "tokens": [1, 2], "extra": ints})
    add("extra/mixed", {"parent": p16, "tokens": [7] * 16, "extra": [
        "my-lora", ["mm-1", -5], ["mm-2", 300], "salt", {"hex": "00ff" * 16}, [], [[1, [2, "x"]]],
        "", "é" * 130, "z" * 256, {"hex": "ab" * 300}, [1, 2, 3, 4, 5]]})
    add("extra/single", {"parent": p32, "tokens": [3], "extra": ["only"]})
    add("extra/emptytuple", {"parent": p32, "tokens": [3], "extra": [[]]})
    for _ in range(40):
        n = rnd.randint(1, 40)
        toks = [rnd.choice(edges) if rnd.random() < 0.3 else rnd.randrange(2**32) >> rnd.randrange(32)
                for _ in range(n)]
        extra = None
        if rnd.random() < 0.7:
            extra = []
            for _ in range(rnd.randint(1, 5)):
                c = rnd.random()
                if c < 0.3:
                    extra.append("k%d" % rnd.randrange(10**6))
                elif c < 0.6:
                    extra.append(["mm-%08x" % rnd.randrange(2**32), rnd.randint(-3000, 3000)])
                elif c < 0.8:
                    extra.append(rnd.randint(-2**63, 2**63 - 1) >> rnd.randrange(63))
                else:
                    extra.append({"hex": "%064x" % rnd.randrange(2**256)})
        add("random/%d" % len(cases), {"parent": rnd.choice([p32, p16]), "tokens": toks, "extra": extra})
    # Frame boundaries: the frame holds 36 bytes (p32) or 20 (p16) before the
    # tokens, 5 bytes per token of this spec, so 13100 tokens end at 65536.
    big = {"a": 7919, "b": 65536, "m": 2**31 - 65536}
    for n in list(range(13096, 13106)) + [20000, 26214, 26215, 40000]:
        for parent, extra in [(p32, None), (p32, ["lora", ["mm", -4096], "salt"]), (p16, None),
                              (p16, [{"str_repeat": ["q", 70000]}])]:
            add("frame/%d/%d/%s" % (n, len(parent) // 2, "none" if extra is None else len(extra)),
                {"parent": parent, "tokens": dict(big, n=n), "extra": extra})
    small = {"a": 1, "b": 0, "m": 256}
    for n in [32760, 32765, 32766, 32767, 32768, 32769]:
        add("frame/small/%d" % n, {"parent": p32, "tokens": dict(small, n=n), "extra": None})
    for n in [65533, 65534, 65535, 65536, 65537, 70000]:
        for where in ["first", "last"]:
            big_s = {"str_repeat": ["s", n]}
            big_b = {"bytes_repeat": ["5a", n]}
            extra = [big_s, "tail", big_b] if where == "first" else ["head", big_b, big_s]
            add("large/%d/%s" % (n, where), {"parent": p32, "tokens": [1, 2, 3], "extra": extra})
    long_tok = {"a": 104729, "b": 2**31, "m": 2**32}
    for n in [9356, 9357, 9358, 9359, 9360]:
        add("frame/long1/%d" % n, {"parent": p32, "tokens": dict(long_tok, n=n), "extra": ["x"]})

    # CPython keeps one object for the empty str and bytes and each
    # one-character latin-1 str and one-byte bytes, so a repeat within a
    # value is pickled as a memo reference (BINGET, or LONG_BINGET past 255).
    add("memo/str1", {"parent": p32, "tokens": [1], "extra": ["a", "a", ["a", 3]]})
    add("memo/empty", {"parent": p32, "tokens": [1], "extra": ["", "", ["", -1], {"hex": ""}, {"hex": ""}]})
    add("memo/latin1", {"parent": p16, "tokens": [1], "extra": ["é", "é", "ā", "ā", "\x7f", "\x7f"]})
    add("memo/bytes1", {"parent": p32, "tokens": [1], "extra": [{"hex": "00"}, {"hex": "00"}, "a", {"hex": "61"}, "a"]})
    add("memo/strnotbytes", {"parent": p32, "tokens": [1], "extra": ["a", {"hex": "61"}]})
    add("memo/long", {"parent": p32, "tokens": [1], "extra": ["k%d" % i for i in range(300)] + ["x", "y", "x", "y"]})
    add("memo/afterlong", {"parent": p32, "tokens": [1], "extra": ["x"] + ["k%d" % i for i in range(300)] + ["x"]})
    for n in range(65470, 65500, 3):
        add("memo/frame/%d" % n, {"parent": p32, "tokens": [1, 2], "extra": [
            {"str_repeat": ["q", n]}, "a", "a", ["a", 1], "a"]})

    for c in cases:
        b = pickle.dumps(value_of(c["value"]), protocol=5)
        c["len"] = len(b)
        c["sha256"] = hashlib.sha256(b).hexdigest()
        if len(b) <= 4096:
            c["hex"] = b.hex()
    json.dump({"python": sys.version.split()[0], "cases": cases}, sys.stdout, indent=0,
              ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
