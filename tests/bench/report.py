#!/usr/bin/python3
"""Turn the guest's results.json into the published benchmark results.

usage: report.py RESULTS_JSON OUT_DIR [--host-cpu S] [--host-cores N]
                 [--host-mem S] [--host-disk S] [--qemu S] [--commit S]

Writes OUT_DIR/results.json (the input plus the host description),
OUT_DIR/results.rst (tables in the kernel's rst style, included by
Documentation/benchmarks.rst) and one PNG chart per workload.  Ratios are
taken between medians measured in the same boot.
"""

import argparse
import json
import os

MIB = 1 << 20

STACK_ORDER = ["raw", "thin", "vdo", "before", "dedup", "fast", "fastack", "ack"]
STACK_LABEL = {"raw": "raw (dm-linear)", "thin": "dm-thin", "vdo": "dm-vdo",
               "dedup": "dm-dedup", "fast": "dm-dedup, xxhash64 verify",
               "fastack": "dm-dedup, xxhash64 verify early_ack",
               "ack": "dm-dedup, early_ack"}
WORKLOAD_TITLE = {
    "seqwrite": "Sequential 1 MiB writes, iodepth 4 (MB/s)",
    "randwrite": "4 KiB random writes, iodepth 32 (IOPS)",
    "randread": "4 KiB random reads after a fill, iodepth 32 (IOPS)",
    "fsync": "4 KiB writes with an fsync after each, iodepth 1 (IOPS)",
}


def fmt(v, unit):
    if unit == "B/s":
        return "%.1f" % (v / 1e6)
    return "%.0f" % v


def rst_table(header, rows):
    cols = list(zip(*([header] + rows)))
    widths = [max(len(str(c)) for c in col) for col in cols]
    sep = "  ".join("=" * w for w in widths)
    out = [sep, "  ".join(str(h).ljust(w) for h, w in zip(header, widths)), sep]
    for r in rows:
        out.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    out.append(sep)
    return "\n".join(out)


def debug_options(cmdline):
    """The guest command line without virtme-ng's own plumbing."""
    if cmdline is None:
        return "not recorded"
    skip = ("virtme", "init=", "console=", "earlyprintk=", "nr_open=", "quiet",
            "loglevel=", "panic=")
    kept = [t for t in cmdline.split() if not t.startswith(skip)]
    return " ".join(kept) or "none (no kernel debugging)"


def ratio(a, b):
    return "%.2fx" % (a / b) if a is not None and b else "-"


def ratio_cells(vals, stack, base=None):
    """vals[stack] ({stack: figure}) against raw's and dm-vdo's, and
    against base[stack] if a base is given."""
    cells = [ratio(vals[stack], vals.get("raw")), ratio(vals[stack], vals.get("vdo"))]
    if base is not None:
        cells.append(ratio(vals[stack], base.get(stack)))
    return cells


def run_cell(r, unit):
    """A run's median (min-max)."""
    return "%s (%s-%s)" % (fmt(r["median"], unit), fmt(r["min"], unit), fmt(r["max"], unit))


def by_key(runs):
    out = {}
    for r in runs:
        out.setdefault((r["workload"], r["param"]), {})[r["stack"]] = r
    return out


def targets(res, groups):
    """The issue's targets for dm-dedup, each as (text, value, goal, met)."""
    out = []

    def med(w, p, s):
        r = groups.get((w, p), {}).get(s)
        return r["median"] if r else None

    def add(text, num, den, goal, higher=True):
        """A bar on the ratio num / den. Either figure missing, or one that
        cannot be a measurement (a denominator <= 0; a negative numerator;
        for a lower-is-better bar, a numerator of 0: no time or memory at
        all), is "not measured", never met."""
        goal_text = ("at least " if higher else "at most ") + "%.2fx" % goal
        if num is None or den is None:
            out.append((text, "not measured", goal_text, "-"))
            return
        if den <= 0 or num < 0 or (num == 0 and not higher):
            out.append((text, "not measured (invalid figures: %g / %g)" % (num, den),
                        goal_text, "-"))
            return
        v = num / den
        met = v >= goal if higher else v <= goal
        out.append((text, "%.2fx" % v, goal_text, "met" if met else "MISSED"))

    def absent(text, goal):
        out.append((text, "not measured", goal, "-"))

    pool = {p["stack"]: p for p in res.get("pool", [])}
    # The early_ack and fast-hash stacks, when measured, get their own rows
    # for the writes, named by their label.
    variants = [("dedup", "dm-dedup")]
    for s in ("fast", "fastack", "ack"):
        if any(r["stack"] == s for r in res.get("runs", [])):
            variants.append((s, STACK_LABEL[s].replace(",", "")))
    for s, name in variants:
        for dup, goal in (("0%", 1.2), ("50%", 1.5), ("90%", 1.2)):
            add("4 KiB random writes, %s duplicates: %s / dm-vdo IOPS" % (
                dup.replace("%", " %"), name),
                med("randwrite", dup, s), med("randwrite", dup, "vdo"), goal)
        # a stack missing from the pool results: the bar is not measured
        add("VM-pool ingest time: %s / dm-vdo" % name, pool.get(s, {}).get("ingest_secs"),
            pool.get("vdo", {}).get("ingest_secs"), 0.8, higher=False)
    est = res.get("pool_estimate")
    stored_text = "VM-pool stored blocks: dm-dedup vs ``dedup estimate`` (4 KiB)"
    if "dedup" in pool and est and est.get("stored_blocks", 0) > 0:
        # The estimator counts the images' blocks; the stack also stores the
        # file system's own metadata, a fraction of a percent here.
        extra = pool["dedup"]["stored_blocks"] - est["stored_blocks"]
        share = 100.0 * extra / est["stored_blocks"]
        out.append((stored_text,
                    "%+d blocks (%+.2f %%)" % (extra, share), "within 0.5 %",
                    "met" if abs(share) <= 0.5 else "MISSED"))
    else:
        absent(stored_text, "within 0.5 %")
    limit = res.get("machine", {}).get("kernel_sha256_4k_all_cpus_bytes_per_sec")
    for s, name in variants:
        for dup, what in (("0%", "unique"), ("100%", "100 %-duplicate")):
            add("sequential %s writes: %s / dm-vdo" % (what, name), med("seqwrite", dup, s),
                med("seqwrite", dup, "vdo"), 2.0)
            # The limit is SHA-256's: it bounds the stacks that hash with it.
            if s not in ("fast", "fastack"):
                add("sequential %s writes: %s / hashing limit" % (what, name),
                    med("seqwrite", dup, s), limit, 0.8)
    add("4 KiB random reads after a fill: dm-dedup / raw", med("randread", "after fill", "dedup"),
        med("randread", "after fill", "raw"), 0.9)
    # Issue 14: an fsync after each write, on both pairs of disks.
    for w, disks in (("fsync", "cache=unsafe"), ("fsync_sync", "cache=none")):
        dd = med(w, "4k+fsync", "dedup")
        add("4 KiB writes + fsync, %s: dm-dedup / raw IOPS" % disks, dd,
            med(w, "4k+fsync", "raw"), 0.7)
        add("4 KiB writes + fsync, %s: dm-dedup / dm-vdo IOPS" % disks, dd,
            med(w, "4k+fsync", "vdo"), 3.0)
    disc = {d["stack"]: d for d in res.get("discard", [])}
    if "dedup" in disc and "vdo" in disc:
        out.append(("%d MiB discard of mapped data: dm-dedup / dm-vdo time" % (
                    disc["dedup"]["bytes"] >> 20),
                    "%.2fx" % (disc["dedup"]["secs"] / disc["vdo"]["secs"]),
                    "timed (no bar)", "-"))
    act = med("activation", "clean", "dedup")
    act_text = "activation holding %s unique blocks after a clean shutdown: dm-dedup" % (
        act_blocks_text(res))
    if act is not None and act > 0:
        out.append((act_text, "%.2f s" % act, "under 2 s", "met" if act < 2.0 else "MISSED"))
    elif act is not None:
        out.append((act_text, "not measured (invalid time: %g s)" % act, "under 2 s", "-"))
    else:
        absent(act_text, "under 2 s")
    vdo_act = med("activation", "clean", "vdo")
    if act is not None and vdo_act:
        out.append(("activation after a clean shutdown: dm-dedup / dm-vdo time",
                    "%.2fx" % (act / vdo_act), "timed (no bar)", "-"))
    crash, vdo_crash = med("activation", "crash", "dedup"), med("activation", "crash", "vdo")
    if crash is not None and vdo_crash:
        out.append(("activation after a crash: dm-dedup / dm-vdo time",
                    "%.2fx" % (crash / vdo_crash), "timed (no bar)", "-"))
    mem = {m["stack"]: m for m in res.get("memory", [])}
    add("kernel RAM per data block: dm-dedup / dm-vdo",
        mem.get("dedup", {}).get("bytes_per_data_block"),
        mem.get("vdo", {}).get("bytes_per_data_block"), 1.0, higher=False)
    x = pool.get("dedup", {}).get("extra", {})
    blocks = mem.get("dedup", {}).get("data_blocks")
    index_text = "index RAM per data block, dm-dedup stats (%s data blocks)" % (
        "%d" % blocks if blocks else "?")
    if x.get("index_bytes", 0) > 0 and blocks and blocks > 0:
        per = x["index_bytes"] / blocks
        out.append((index_text, "%.2f B" % per, "at most 4 B",
                    "met" if per <= 4.0 else "MISSED"))
    else:
        absent(index_text, "at most 4 B")
    if "dedup" in pool and "dedup" in mem:
        # Runs of a module with the compact index (issue 16) only.
        if "index_false_candidates" in x:
            lookups = x["unique_writes"] + x["duplicate_writes"]
            out.append(("VM pool: index false candidates per lookup (%d of %d)" % (
                        x["index_false_candidates"], lookups),
                        "%.5f" % (x["index_false_candidates"] / max(1, lookups)),
                        "measured (no bar)", "-"))
            per16 = index_bytes_for(1 << 32) / (1 << 32)
            out.append(("index RAM per data block computed for 16 TiB (2^32 blocks)",
                        "%.2f B" % per16, "at most 4 B", "met" if per16 <= 4.0 else "MISSED"))
    return out


def index_bytes_for(data_blocks):
    """dd_index_bytes_for() of dedup-index.c: the geometry of
    Documentation/dedup-format.rst ("Saved state")."""
    leaves = -(-data_blocks // 127)
    leaf_bits = max(1, leaves.bit_length())
    entry_bits = max(30, leaf_bits + 4)
    buckets = max(2, -(-data_blocks * 100 // (95 * 8)))
    return -(-(buckets * 8 * entry_bits) // 64) * 8


def act_blocks_text(res):
    n = res.get("config", {}).get("activation_blocks")
    return "%dM" % (n >> 20) if n and n >= 1 << 20 else str(n or "?")


def activation_section(res, groups):
    rows = []
    for param, what in (("clean", "after a clean shutdown"), ("crash", "after a crash")):
        for stack, r in sorted(groups.get(("activation", param), {}).items(),
                               key=lambda kv: list(STACK_LABEL).index(kv[0])
                               if kv[0] in STACK_LABEL else 99):
            runs = r["runs"][1:]
            kernel = [x["kernel_ms"] for x in runs if "kernel_ms" in x]
            source = ""
            if stack == "dedup":
                source = "loaded" if all(x.get("index_loaded") for x in runs) else "rebuilt"
            rows.append([what, STACK_LABEL.get(stack, stack),
                         "%.2f (%.2f-%.2f)" % (r["median"], r["min"], r["max"]),
                         "%d" % sorted(kernel)[len(kernel) // 2] if kernel else "-",
                         source or "-"])
    if not rows:
        return []
    return ["Activation\n----------\n",
            "A device holding %s unique 4 KiB blocks (written with 1 MiB writes), removed "
            "and created again: the time ``dmsetup create`` takes. After a clean shutdown "
            "dm-dedup loads the index and allocation state it saved at removal; after a "
            "crash (here: its metadata disk failed every write during the removal, so "
            "neither a final commit nor a save reached it) it rebuilds them from the "
            "trees. dm-vdo's crash is made the same way on its one disk, and its "
            "activation then recovers from its journal. Kernel ms: dm-dedup's "
            "own count (``activation_ms`` in the stats message), median.\n" % (
                act_blocks_text(res)),
            rst_table(["case", "stack", "seconds", "kernel ms", "index"], rows), ""]


def sync_section(res, groups):
    """The fsync workload and the VM-pool copy on the cache=none disks."""
    fsync = groups.get(("fsync_sync", "4k+fsync"), {})
    pool = {p["stack"]: p for p in res.get("pool_sync", [])}
    if not fsync and not pool:
        return []
    title = "On disks that honour flushes (cache=none)"
    out = [title + "\n" + "-" * len(title) + "\n",
           "The fsync workload and the VM-pool copy once more, with the same stacks, "
           "workload sizes and repetitions, on a second pair of data and metadata "
           "disks that QEMU attaches with ``cache=none``: it opens their files with "
           "O_DIRECT and turns every guest flush into an ``fdatasync`` of the file, so "
           "each flush a stack sends waits for the host's disk. x cache=unsafe: the "
           "figure against the same stack's on the ``cache=unsafe`` disks above, same "
           "boot. The flushes each stack sent are in the write amplification table "
           "(fsync_sync, pool_sync); stored blocks and kernel memory are not measured "
           "again.\n"]
    if fsync:
        unsafe = groups.get(("fsync", "4k+fsync"), {})
        iops = {s: r["median"] for s, r in fsync.items()}
        rows = [[STACK_LABEL[s], run_cell(fsync[s], "IOPS")] +
                ratio_cells(iops, s, {t: r["median"] for t, r in unsafe.items()})
                for s in STACK_ORDER if s in fsync]
        out += [WORKLOAD_TITLE["fsync"] + "\n" + "~" * len(WORKLOAD_TITLE["fsync"]) + "\n",
                rst_table(["stack", "IOPS", "x raw", "x dm-vdo", "x cache=unsafe"], rows), ""]
    if pool:
        secs = {s: p["ingest_secs"] for s, p in pool.items()}
        unsafe = {p["stack"]: p["ingest_secs"] for p in res.get("pool", [])}
        rows = [[STACK_LABEL[s], "%.1f" % secs[s]] + ratio_cells(secs, s, unsafe)
                for s in STACK_ORDER if s in pool]
        title = "VM-pool ingest: ``cp`` then ``sync`` (seconds)"
        out += [title + "\n" + "~" * len(title) + "\n",
                rst_table(["stack", "ingest s", "time x raw", "time x dm-vdo",
                           "time x cache=unsafe"], rows), ""]
    return out


def pyplot():
    """matplotlib without a display (imported late: only charts need it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def chart(path, title, unit, groups_for_workload):
    plt = pyplot()
    params = list(groups_for_workload)
    stacks = [s for s in STACK_ORDER if any(s in groups_for_workload[p] for p in params)]
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    width = 0.8 / max(1, len(stacks))
    scale = 1e6 if unit == "B/s" else 1
    for i, s in enumerate(stacks):
        xs, ys, lo, hi = [], [], [], []
        for j, p in enumerate(params):
            r = groups_for_workload[p].get(s)
            if not r:
                continue
            xs.append(j + (i - (len(stacks) - 1) / 2) * width)
            ys.append(r["median"] / scale)
            lo.append((r["median"] - r["min"]) / scale)
            hi.append((r["max"] - r["median"]) / scale)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=STACK_LABEL[s])
    ax.set_xticks(range(len(params)))
    ax.set_xticklabels([p + (" duplicates" if p.endswith("%") else "") for p in params])
    ax.set_ylabel("MB/s" if unit == "B/s" else unit)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def pool_chart(path, res):
    plt = pyplot()
    pool = {p["stack"]: p for p in res["pool"]}
    mem = {m["stack"]: m for m in res.get("memory", [])}
    stacks = [s for s in STACK_ORDER if s in pool]
    labels = [STACK_LABEL[s] for s in stacks]
    colors = ["C%d" % STACK_ORDER.index(s) for s in stacks]
    fig, axs = plt.subplots(1, 3, figsize=(10, 3.4), dpi=100)
    panels = [
        ("ingest time (s)", [pool[s]["ingest_secs"] for s in stacks]),
        ("stored (GiB)", [pool[s]["stored_blocks"] * 4096 / 2**30 for s in stacks]),
        ("kernel memory per data block (B)",
         [max(0.0, mem[s]["bytes_per_data_block"]) if s in mem else 0 for s in stacks]),
    ]
    for ax, (title, vals) in zip(axs, panels):
        ax.bar(range(len(stacks)), vals, color=colors)
        ax.set_xticks(range(len(stacks)))
        ax.set_xticklabels(labels, rotation=20, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    est = res.get("pool_estimate")
    if est:
        axs[1].axhline(est["stored_blocks"] * 4096 / 2**30, color="k", linestyle="--",
                       linewidth=1, label="dedup estimate")
        axs[1].legend(fontsize=8)
    fig.suptitle("VM image pool: %d images, %.1f GiB apparent" % (
        len(est["images"]) if est else 0, (est or {}).get("apparent_bytes", 0) / 2**30),
        fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


IMAGE_DIR = "benchmarks"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("out")
    ap.add_argument("--host-cpu", default="")
    ap.add_argument("--host-cores", default="")
    ap.add_argument("--host-mem", default="")
    ap.add_argument("--host-disk", default="")
    ap.add_argument("--qemu", default="")
    ap.add_argument("--commit", default="")
    a = ap.parse_args()
    # Images as the page that includes results.rst names them: relative
    # to Documentation/ (benchmarks.rst), wherever the results go.
    global IMAGE_DIR
    docs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                        "Documentation")
    IMAGE_DIR = os.path.relpath(os.path.abspath(a.out), os.path.abspath(docs))

    with open(a.results) as f:
        res = json.load(f)
    # Only what was given: re-rendering published results keeps the rest.
    given = {k: v for k, v in (("host_cpu", a.host_cpu), ("host_cores", a.host_cores),
                               ("host_mem", a.host_mem), ("host_disk", a.host_disk),
                               ("qemu", a.qemu), ("commit", a.commit)) if v}
    res["machine"].update(given, accel="TCG (software emulation)")
    os.makedirs(a.out, exist_ok=True)
    groups = by_key(res["runs"])
    cfg, mach = res["config"], res["machine"]
    STACK_LABEL["before"] = "dm-dedup at %s" % (cfg.get("before_commit") or "an earlier commit")
    if cfg.get("dedup_opts"):
        STACK_LABEL["dedup"] = "dm-dedup, %s" % " ".join(cfg["dedup_opts"])

    disks = [
        ["data disk", "%d GiB virtio-blk, raw file, cache=%s" % (
            cfg["data_bytes"] >> 30, cfg.get("disk_cache", {}).get("data+meta", "unsafe"))],
        ["metadata disk", "%d MiB virtio-blk (dm-thin, dm-dedup)" % (cfg["meta_bytes"] >> 20)],
    ]
    if "sync_data_bytes" in cfg:
        disks.append(["flush-honouring disks", "datasync %d GiB and metasync %d MiB "
                      "virtio-blk, raw files%s, cache=%s: a guest flush is an fdatasync "
                      "on the host" % (cfg["sync_data_bytes"] >> 30, cfg["sync_meta_bytes"] >> 20,
                                       " on %s" % mach["host_disk"] if mach.get("host_disk")
                                       else "", cfg["disk_cache"]["datasync+metasync"])])

    doc = []
    doc.append(".. Generated by tests/bench/report.py from results.json: do not edit.\n")
    doc.append("Machine and run\n---------------\n")
    doc.append(rst_table(["item", "value"], [
        ["host CPU", "%s, %s cores, %s RAM" % (mach.get("host_cpu"), mach.get("host_cores"),
                                               mach.get("host_mem"))],
        ["emulator", "%s, TCG (no KVM)" % mach.get("qemu")],
        ["guest", "Linux %s, %s vCPUs, %d MiB" % (mach["guest_kernel"], mach["guest_cpus"],
                                                 mach["guest_mem_kib"] // 1024)],
        ["guest kernel options", debug_options(mach.get("guest_cmdline"))],
        ["guest CPU (TCG)", "one vCPU in user space: SHA-256 of 4 KiB blocks %.0f MB/s "
         "(OpenSSL), memcpy %.0f MB/s; the kernel hashes with %s" % (
             mach.get("sha256_4k_bytes_per_sec", 0) / 1e6,
             mach.get("memcpy_bytes_per_sec", 0) / 1e6, mach.get("sha256_driver") or "-")],
        ["hashing limit", "%.0f MB/s: the kernel's SHA-256 of 4 KiB blocks on all vCPUs "
         "at once (AF_ALG, this boot)" % (
             mach.get("kernel_sha256_4k_all_cpus_bytes_per_sec", 0) / 1e6)],
        ["fio / vdo tools", "%s / %s" % (mach["fio"], mach["vdo_tools"])],
        ["dm-dedup commit", mach.get("commit", "-")],
    ] + disks + [
        ["repetitions", "%d measured after 1 warm-up; medians, min-max" % cfg["reps"] + (
            "; the write series: %d rounds of %d, each on a fresh device after its own "
            "warm-up, the stacks taking turns" % (
                cfg["rounds"], -(-cfg["reps"] // cfg["rounds"]))
            if cfg.get("rounds", 1) > 1 else "")],
        ["run time", "%.0f min in the guest" % (res.get("total_secs", 0) / 60)],
    ]))
    doc.append("")

    doc.append("Targets\n-------\n")
    doc.append(rst_table(["target (ratio of medians, same boot)", "measured", "goal", ""],
                         [list(t) for t in targets(res, groups)]))
    doc.append("")

    doc.append("fio workloads\n-------------\n")
    doc.append("Each cell: median (min-max) over the measured repetitions.\n")
    for w in ("seqwrite", "randwrite", "randread", "fsync"):
        params = [p for (ww, p) in groups if ww == w]
        if not params:
            continue
        wg = {p: groups[(w, p)] for p in params}
        unit = next(iter(wg[params[0]].values()))["unit"]
        doc.append(WORKLOAD_TITLE[w] + "\n" + "~" * len(WORKLOAD_TITLE[w]) + "\n")
        rows = []
        for p in params:
            g = wg[p]
            medians = {s: r["median"] for s, r in g.items()}
            rows += [[p, STACK_LABEL[s], run_cell(g[s], unit)] + ratio_cells(medians, s)
                     for s in STACK_ORDER if s in g]
        doc.append(rst_table(["", "stack", "MB/s" if unit == "B/s" else unit, "x raw",
                              "x dm-vdo"], rows))
        png = "%s.png" % w
        chart(os.path.join(a.out, png), WORKLOAD_TITLE[w], unit, wg)
        doc.append("\n.. image:: %s/%s\n" % (IMAGE_DIR, png))

    if res.get("discard"):
        n = res["discard"][0]["bytes"] >> 20
        doc.append("Discard of mapped data\n----------------------\n")
        doc.append("%d MiB written with 1 MiB writes at 50 %% duplicates, then discarded "
                   "with one ``blkdiscard`` (after a first, unmeasured one of another "
                   "%d MiB), while fio keeps 4 KiB random reads at iodepth 4 going on a "
                   "64 MiB region outside it.\n" % (n, n))
        rows = [[STACK_LABEL[d["stack"]], "%.1f" % d["secs"], "%.0f" % d["read_iops"],
                 "%.0f" % d["read_p99_us"]] for d in res["discard"]]
        doc.append(rst_table(["stack", "discard (s)", "reads meanwhile (IOPS)",
                              "read p99 (us)"], rows))
        doc.append("")

    doc.extend(activation_section(res, groups))

    if res.get("checks"):
        doc.append("Duplicate ratio of the generated data\n"
                   "-------------------------------------\n")
        doc.append("What fio really wrote, measured three ways: ``dedup estimate`` over "
                   "the raw device's written region, and the share of written blocks that "
                   "dm-dedup and dm-vdo did not store.\n")
        rows = []
        for c in res["checks"]:
            key = (c["workload"], c["param"])
            row = next((r for r in rows if r[0] == key), None)
            if row is None:
                row = [key, "-", "-", "-"]
                rows.append(row)
            if "estimate" in c:
                row[1] = "%.2f %%" % c["estimate"]["duplicate_percent"]
            if "dedup_duplicate_percent" in c:
                row[2] = "%.2f %%" % c["dedup_duplicate_percent"]
            if "vdo_duplicate_percent" in c:
                row[3] = "%.2f %%" % c["vdo_duplicate_percent"]
        doc.append(rst_table(["workload", "estimator", "dm-dedup", "dm-vdo"],
                             [["%s %s" % r[0]] + r[1:] for r in rows]))
        doc.append("")

    if res.get("pool"):
        est = res.get("pool_estimate", {})
        doc.append("VM image pool\n-------------\n")
        doc.append("%d images, %.0f MiB apparent size, copied with ``cp`` onto a fresh ext4 "
                   "on each stack, then ``sync``. ``dedup estimate`` over the images: %d "
                   "blocks of 4 KiB, %d all-zero, %d distinct non-zero (%.2f %% savings). "
                   "Stored blocks: what the stack allocated during the copy, including "
                   "the metadata the file system wrote then (for the raw device: the "
                   "blocks the file system allocated; dm-thin allocates 64 KiB "
                   "chunks).\n" % (
                       len(est.get("images", [])), est.get("apparent_bytes", 0) / 2**20,
                       est.get("blocks", 0), est.get("zero_blocks", 0),
                       est.get("stored_blocks", 0), est.get("savings_percent", 0)))
        pool = {p["stack"]: p for p in res["pool"]}
        secs = {s: p["ingest_secs"] for s, p in pool.items()}
        rows = []
        for s in STACK_ORDER:
            p = pool.get(s)
            if not p:
                continue
            rows.append([STACK_LABEL[s], "%.1f" % p["ingest_secs"]] + ratio_cells(secs, s) +
                        ["%d" % p["stored_blocks"],
                         "%.2f %%" % p["savings_percent"],
                         "%+d" % (p["stored_blocks"] - est["stored_blocks"]) if est else "-"])
        doc.append(rst_table(["stack", "ingest s", "time x raw", "time x dm-vdo",
                              "stored blocks", "savings", "vs estimate"], rows))
        pool_chart(os.path.join(a.out, "pool.png"), res)
        doc.append("\n.. image:: %s/pool.png\n" % IMAGE_DIR)

    doc.extend(sync_section(res, groups))

    if res.get("write_amp"):
        doc.append("Write amplification\n-------------------\n")
        doc.append("Bytes written to the data disk and to the metadata disk per byte the "
                   "workload wrote, from the disks' own counters (``/sys/block/*/stat``) "
                   "over the whole series (warm-up included) and one final flush, so that "
                   "each stack's last commit is counted. For the VM pool, the bytes "
                   "written are the images' apparent size (``cp`` skips their holes, and "
                   "ext4's own metadata is part of the data disk's figure). dm-vdo keeps "
                   "everything on one disk, the raw device has no metadata disk. Flushes: "
                   "flush requests that reached the data / metadata disk.\n")
        amp = {}
        for r in res["write_amp"]:
            amp[(r["workload"], r["param"], r["stack"])] = r
        keys = []
        for r in res["write_amp"]:
            if (r["workload"], r["param"]) not in keys:
                keys.append((r["workload"], r["param"]))
        stacks = [s for s in STACK_ORDER if any(k[2] == s for k in amp)]
        rows = []
        for w, p in keys:
            row = ["%s %s" % (w, p)]
            for st in stacks:
                r = amp.get((w, p, st))
                row.append("%.3f / %.3f (%d / %d)" % (
                    r["data_per_user_byte"], r["meta_per_user_byte"], r["data_flushes"],
                    r["meta_flushes"]) if r else "-")
            rows.append(row)
        doc.append(rst_table(["workload"] + ["%s: data / meta (flushes)" % STACK_LABEL[st]
                                             for st in stacks], rows))
        doc.append("")
        # Runs written older than this table have no request counts.
        if any("data_writes" in r for r in res["write_amp"]):
            doc.append("Data write requests\n~~~~~~~~~~~~~~~~~~~\n")
            doc.append("Write requests the data disk completed per MiB the workload wrote, "
                       "from the same counters: 256 is one request per 4 KiB block; fewer "
                       "means the block layer merged the stack's bios, or the stack wrote "
                       "larger ones (or less data: a duplicate writes none).\n")
            rows = []
            for w, p in keys:
                row = ["%s %s" % (w, p)]
                for st in stacks:
                    r = amp.get((w, p, st))
                    row.append("%.1f" % (r["data_writes"] * MIB / r["user_bytes"])
                               if r and "data_writes" in r else "-")
                rows.append(row)
            doc.append(rst_table(["workload"] + [STACK_LABEL[st] for st in stacks], rows))
            doc.append("")

    if res.get("memory"):
        doc.append("Kernel memory\n-------------\n")
        doc.append("Kernel memory held after the VM-pool copy, with the file system "
                   "unmounted and caches dropped (``drop_caches``), minus the same figure "
                   "before the stack was created: MemTotal - MemFree - Buffers - Cached. "
                   "Per data block: divided by the %d blocks of the data disk. dm-vdo's "
                   "figure includes its fixed block-map cache (128 MiB) and UDS index; "
                   "dm-dedup's its index (about 4 bytes per data block since target version 1.2, 10 before) and whatever the "
                   "metadata cache held that drop_caches did not release. The raw and "
                   "thin rows show the noise of this figure (user space, page tables). "
                   "The slab+vmalloc+percpu column is the change in the kernel's own "
                   "counters (SUnreclaim, VmallocUsed, Percpu), which miss large "
                   "kmallocs and page allocations.\n" % (
                       res["memory"][0]["data_blocks"]))
        rows = []
        for m in res["memory"]:
            idx = "-"
            if m["stack"] == "dedup":
                ib = next((p["extra"].get("index_bytes") for p in res.get("pool", [])
                           if p["stack"] == "dedup"), None)
                idx = "%.1f MiB" % (ib / 2**20) if ib else "-"
            counted = m.get("counted_delta_kib")
            rows.append([STACK_LABEL[m["stack"]], "%.1f MiB" % (m["delta_kib"] / 1024),
                         "%.2f" % m["bytes_per_data_block"],
                         "%.2f" % m["bytes_per_stored_block"],
                         "%.1f MiB" % (counted / 1024) if counted is not None else "-", idx])
        doc.append(rst_table(["stack", "kernel memory", "B per data block",
                              "B per stored block", "slab+vmalloc+percpu", "dm-dedup index"],
                             rows))
        doc.append("")

    with open(os.path.join(a.out, "results.rst"), "w") as f:
        f.write("\n".join(doc) + "\n")
    out_json = os.path.join(a.out, "results.json")
    with open(out_json + ".tmp", "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    os.replace(out_json + ".tmp", out_json)
    print("report: wrote %s" % os.path.join(a.out, "results.rst"))


if __name__ == "__main__":
    main()
