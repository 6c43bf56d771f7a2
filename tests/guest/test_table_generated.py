"""Malformed table lines and messages from a generated list (tests/README.md, "Test levels" 4:
faults; Documentation/dm-dedup.rst "Table line", "Messages").

Each generated table line breaks exactly one rule of the grammar, so it is
invalid by construction: `dmsetup create` must fail, leave no device and log
a dedup line saying what is wrong.  Each generated message is not one the
target knows: it must fail with a logged line and leave the device working.
The list is drawn from a fixed seed; DD_TORTURE_TRIALS scales its length.
"""

import random
import string

import ddlib
from ddlib import MIB, BlockDev, block_data, run
from test_table import assert_create_fails

N = 40 * max(1, ddlib.TORTURE_TRIALS)
L = 256 * MIB // 512

OPTIONS = {          # option -> (valid value or None for a flag)
    "hash": "sha256",
    "verify": None,
    "commit_interval": "5",
    "discard_passdown": None,
    "low_water_mark": "100",
    "early_ack": None,
    "read_only": None,
    "no_read_batching": None,
}
BAD_NUMBERS = {
    "commit_interval": ["0", "3601", "-1", "abc", "1e3", "0x10", "", "99999999999999999999"],
    "low_water_mark": ["-1", "x", "1.5", "18446744073709551616", "", "0x"],
}
GARBAGE = ["frob", "--verify", "verify=1", "hash=sha256", "commit-interval", "%s",
           "\\x00", "readonly", "discard", "0", "-"]


def valid_options(rng):
    names = rng.sample([o for o in OPTIONS if o != "read_only"], rng.randint(0, 3))
    toks = []
    for n in names:
        toks.append(n)
        if OPTIONS[n] is not None:
            toks.append(OPTIONS[n])
    return toks


def generate(meta, data, seed, n):
    """[(description, table line, keywords)]: each line breaks one rule;
    the message the target must give names one of the keywords."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        opts = valid_options(rng)
        rule = rng.randrange(6)
        if rule == 0:        # argument count does not match the options
            k = rng.choice([d for d in (-2, -1, 1, 2, 5) if len(opts) + d >= 0 and
                            not (len(opts) + d == 0 and not opts)])
            line = "0 %d dedup %s %s %d %s" % (L, meta, data, len(opts) + k, " ".join(opts))
            what = "count %d for %d args" % (len(opts) + k, len(opts))
            keys = ["Invalid number of optional arguments", "Too many arguments"]
        elif rule == 1:      # an option that does not exist
            bad = rng.choice(GARBAGE + ["".join(rng.choices(string.ascii_lowercase + "_",
                                                            k=rng.randint(1, 20)))])
            if bad in OPTIONS or not bad.strip():
                continue
            toks = opts[:]
            toks.insert(rng.randrange(len(toks) + 1) if not toks else
                        rng.choice([i for i in range(len(toks) + 1)
                                    if i == len(toks) or toks[i] in OPTIONS]), bad)
            line = "0 %d dedup %s %s %d %s" % (L, meta, data, len(toks), " ".join(toks))
            what = "unknown option %r" % bad
            keys = ["Unknown or incomplete optional argument"]
        elif rule == 2:      # a numeric option with a bad value
            name = rng.choice(list(BAD_NUMBERS))
            val = rng.choice(BAD_NUMBERS[name])
            if not val:
                toks = [name]                     # value missing
            else:
                toks = [name, val]
            line = "0 %d dedup %s %s %d %s" % (L, meta, data, len(toks), " ".join(toks))
            what = "%s %r" % (name, val)
            keys = ["Invalid %s" % name] if val else ["Unknown or incomplete optional argument"]
        elif rule == 3:      # a device that does not exist, in either position
            ghost = "/dev/" + "".join(rng.choices(string.ascii_lowercase, k=8))
            m, d = (ghost, data) if rng.random() < 0.5 else (meta, ghost)
            line = "0 %d dedup %s %s" % (L, m, d)
            what = "missing device %s" % ghost
            keys = ["Cannot open metadata device" if m == ghost else "Cannot open data device"]
        elif rule == 4:      # too few positional arguments
            parts = [meta, data][:rng.randint(0, 1)]
            line = "0 %d dedup %s" % (L, " ".join(parts))
            what = "%d positional args" % len(parts)
            keys = ["Missing arguments"]
        else:                # a weak hash without verify, or an unknown hash
            h = rng.choice(["crc32c", "xxhash64", "md4x", "sha257", "HMAC(sha256)"])
            toks = ["hash", h]
            line = "0 %d dedup %s %s 2 %s" % (L, meta, data, " ".join(toks))
            what = "hash %s" % h
            keys = ["not collision resistant"] if h in ("crc32c", "xxhash64") else \
                ["unknown hash algorithm", "keyed hash algorithms are not supported"]
        out.append((what, line.rstrip(), keys))
    return out


def test_generated_bad_table_lines(backing, seed):
    meta, data = backing.loop(16, "meta"), backing.loop(64, "data")
    cases = generate(meta, data, seed, N)
    for what, line, keys in cases:
        try:
            assert_create_fails("ddtgen", line, keys)
        except AssertionError as e:
            raise AssertionError("%s: %s" % (what, e))
    ddlib.report("generated table lines refused: %d" % len(cases))


def bad_messages(seed, n):
    rng = random.Random(seed)
    fixed = [["stats", "now"], ["commit", "1"], ["stat"], ["comit"], ["status"],
             ["set_option", "verify"], ["release_metadata_snap"], ["commit-now"],
             ["commit;stats"], ["0"], ["stats", "stats"]]
    out = list(fixed)
    while len(out) < n:
        # no leading '-': dmsetup would take the word as its own option
        toks = [rng.choice(string.ascii_letters) +
                "".join(rng.choices(string.ascii_letters + string.digits + "_-",
                                    k=rng.randint(0, 11))) for _ in range(rng.randint(1, 4))]
        if len(toks) == 1 and toks[0].lower() in ("stats", "commit"):
            continue
        out.append(toks)
    return out


def test_generated_bad_messages(dedup, kmsg_check, seed):
    with BlockDev(dedup.path) as bd:
        bd.write(3, block_data(seed, 1))
    msgs = bad_messages(seed, N // 2)
    for toks in msgs:
        k = ddlib.Kmsg()
        p = run(["dmsetup", "message", dedup.name, "0"] + toks, check=False)
        lines = [l for l in k.lines() if "unknown message" in l]
        k.close()
        assert p.returncode != 0, "message %r succeeded" % toks
        assert lines, "message %r: no 'unknown message' line in the log" % toks
    st = dedup.status()
    assert st["mode"] == "rw", st
    with BlockDev(dedup.path) as bd:
        assert bd.read(3) == block_data(seed, 1)
    dedup.commit()
    ddlib.report("generated messages refused: %d" % len(msgs))
