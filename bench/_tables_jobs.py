"""The tables of the parts that run training jobs (overhead, recovery, flush, EC overhead).

Used by ``bench/_tables.py``'s ``BODIES``; figures only, from the parts' results JSON.
"""

from __future__ import annotations

from typing import Any

from bench import _stats as st
from bench._stats import GiB, MiB, fmt, stat
from bench._tables_base import Doc, mib, table


def overhead(doc: Doc) -> dict[str, list[str]]:
    """Section ``overhead``: per configuration, then every block."""
    r = doc["result"]
    mb = (r["params_m"] or 0) * 12
    out = [
        f"- model: the example's GPT at {fmt(r['params_m'])} M parameters = {mb:.0f} MB of state "
        f"per rank, {r['nproc']} ranks on one node (gloo, one torch thread each)"
        + (f", `--step-delay {r['step_delay']:g}`" if r["step_delay"] else ""),
        f"- {r['cycles']} cycles of one {r['block']}-step block per configuration, after "
        f"{r['warmup_steps']} warm-up steps; median (min-max) over the cycles",
        "",
        "```",
        f"# {r['command']}",
        "```",
        "",
    ]
    rows = []
    for c in r["step_s"]:
        floor = c == "none"
        rows.append(
            [
                c,
                stat(r["step_s"][c], ".4f", " s"),
                "0 (the floor)" if floor else st.pct(r["ratio"].get(c, [])),
                "0 (the floor)" if floor else st.pct(r["cpu_ratio"].get(c, [])),
                stat(r["cpu_s"][c], ".4f", " s"),
                stat(r["saves"][c], ".0f") if not c.startswith("none") else "-",
                stat(r["skipped"][c], ".0f") if c.startswith("ftmem") else "-",
            ]
        )
    head = ["configuration", "time per step", "overhead vs none (wall)", "rank CPU vs none"]
    head += ["rank CPU per step", "snapshots per cycle", "skipped per cycle"]
    out += table(head, rows)
    blocks = [
        [
            b["cycle"],
            b["config"],
            f"{b['seconds'] / b['steps']:.4f} s",
            f"{b['cpu_s'] / b['steps']:.4f} s",
            b["saves"],
            b["skipped"],
        ]
        for b in r["blocks"]
    ]
    out += ["<details><summary>Every block, in the order run</summary>", ""]
    out += table(
        ["cycle", "configuration", "time per step", "rank CPU per step", "snapshots", "skipped"],
        blocks,
    )
    return {"overhead": [*out, "</details>", ""]}


FLUSH_SYSTEMS = ("ftmem export_dcp", "ftmem FLUSH (SMP worker)", "dcp.save", "torch.save")


def _flush_size(r: Doc) -> list[str]:
    out = [f"#### {r['nbytes'] / GiB:.2f} GiB state (requested {r['size_gib']:g} GiB)", ""]
    rows = []
    for s in (s for s in FLUSH_SYSTEMS if s in r["times"]):
        rows.append(
            [
                s,
                stat(r["times"][s], ".2f", " s"),
                stat(st.gbps(r["nbytes"], r["times"][s]), ".3f", " GB/s"),
                stat(r["cpu"].get(s, []), ".2f"),
                stat(st.scale(r["faults"].get(s, []), 1e-3), ".0f", " k"),
                mib(r["mem"].get(s, [])),
                f"{r['disk_bytes'].get(s, 0) / MiB:.0f} MiB",
            ]
        )
    head = ["system", "time", "throughput", "CPU s (writer process)", "minor page faults"]
    out += table([*head, "peak memory added (RssAnon)", "on disk"], rows)
    reps = []
    for i, row in enumerate(r["per_repeat"]):
        d, e, f = (row.get(k) for k in ("dcp.save", "ftmem export_dcp", "ftmem FLUSH (SMP worker)"))
        order = " > ".join(r["orders"][i])
        reps.append(
            [
                i,
                order,
                fmt(d, ".2f", " s"),
                fmt(e, ".2f", " s"),
                fmt(st.ratio(d, e), ".2f", "x"),
                f"{fmt(f, '.2f', ' s')}; {fmt(row.get('flush_smp_s'), '.2f', ' s')}",
                fmt(st.ratio(d, f), ".2f", "x"),
            ]
        )
    head = ["repeat", "order", "dcp.save", "export_dcp", "export/dcp throughput"]
    out += table(
        [*head, "FLUSH (request to reply; SMP's own figure)", "FLUSH/dcp throughput"], reps
    )
    if r["phases"]:
        total = st.median(r["times"]["ftmem export_dcp"])
        ph = [
            [k, stat(v, ".3f", " s"), fmt(st.ratio(st.median(v), total), ".0%")]
            for k, v in r["phases"].items()
        ]
        ph.append(["export_dcp's own dcp.save: CPU s", stat(r["inner_cpu"]), "-"])
        ph.append(
            [
                "export_dcp's own dcp.save: minor page faults",
                stat(st.scale(r["inner_faults"], 1e-3), ".0f", " k"),
                "-",
            ]
        )
        out += table(["phase of export_dcp", "time", "share"], ph)
    out += table(["one-off figure", "seconds"], [[k, fmt(v, ".2f")] for k, v in r["once"].items()])
    return out + [f"- {n}" for n in r["notes"]] + ([""] if r["notes"] else [])


def flush_train(r: Doc) -> dict[str, Any]:
    """Figures of the training runs: per config, and the flush/no-flush ratios of pairs."""
    ok = [x for x in r["train"] if x["ok"]]
    step = {id(x): st.median(x["rank_median"].values()) for x in ok}
    by = {c: [x for x in ok if x["config"] == c] for c in ("no flush", "flush every 5")}
    by["flush every 5"] = [x for x in ok if x["config"] != "no flush"]
    plain = {x["repeat"]: x for x in by["no flush"]}
    pairs = [(plain[x["repeat"]], x) for x in by["flush every 5"] if x["repeat"] in plain]

    def during(x: Doc) -> list[Any]:
        return [f for f in x["flushes"] if x["train_end"] is not None and f[0] <= x["train_end"]]

    def share(x: Doc) -> float | None:
        span = (x["train_end"] or 0) - (x["train_start"] or 0)
        return sum(f[2] for f in during(x)) / span if span > 0 else None

    return {
        "by": by,
        "step": step,
        "ratios": [st.ratio(step[id(b)], step[id(a)]) for a, b in pairs],
        "during": during,
        "share": share,
    }


def flush(doc: Doc) -> dict[str, list[str]]:
    """Section ``flush``: throughput per size, then step time while flushing."""
    r = doc["result"]
    out = [
        f"- throughput: {r['repeats']} repeats per size, systems in an order rotated each repeat; "
        "GB/s = state bytes / wall time; every write fsync'd and removed before the next",
        f"- `import torch.distributed.checkpoint` after `import torch`, fresh process: {fmt(r['dcp_import_s'])} s",
        "",
        "### Throughput",
        "",
    ]
    for size in r["sizes"]:
        out += _flush_size(size)
    if not r["train"]:
        return {"flush": out}
    t = flush_train(r)
    out += [
        "### Step time while flushing",
        "",
        f"`ftmem-launch --nproc-per-node {r['nproc']} --ftmem-slots 3 [--ftmem-flush-dir D "
        f"--ftmem-flush-every {r['flush_every']}] {' '.join(r['example_args'])}`: a snapshot "
        "after every step; a run's step time = the median over its ranks of each rank's median",
        "",
    ]
    rows = []
    for c, xs in t["by"].items():
        flushing = c != "no flush"
        rows.append(
            [
                c,
                stat([t["step"][id(x)] for x in xs], ".4f", " s"),
                stat(t["ratios"], ".3f") if flushing else "1",
                stat([len(t["during"](x)) for x in xs], ".0f") if flushing else "-",
                stat([len(x["flushes"]) for x in xs], ".0f") if flushing else "-",
                stat([f[2] for x in xs for f in x["flushes"]], ".2f", " s") if flushing else "-",
                stat(st.scale([t["share"](x) for x in xs], 100), ".0f", "%") if flushing else "-",
                stat([sum(x["skipped"].values()) for x in xs], ".0f"),
            ]
        )
    head = ["config", "step time", "vs no flush (per pair)", "flushes during training"]
    head += [
        "flushes in all",
        "seconds per flush",
        "flushing's share of training",
        "snapshots skipped",
    ]
    out += table(head, rows)
    runs = []
    for x in r["train"]:
        steps = " ".join(
            f"{f[1]}{'*' if x['train_end'] and f[0] > x['train_end'] else ''}" for f in x["flushes"]
        )
        runs.append(
            [
                x["repeat"],
                x["config"],
                fmt(x["load_start"]),
                ", ".join(fmt(v, ".4f") for v in x["rank_median"].values()),
                ", ".join(fmt(v, ".4f") for v in x["rank_mean"].values()),
                steps or "-",
                f"{x['status_flushes']} / {sum(x['skipped'].values())}",
                f"{x['wall_s']:.0f} s",
                x["error"] or "; ".join(x["failed"]) or "ok",
            ]
        )
    head = [
        "repeat",
        "config",
        "load",
        "median step (ranks)",
        "mean step (ranks)",
        "flushed steps (* = after the last step)",
    ]
    out += table([*head, "STATUS flushes / skipped", "wall", "status"], runs)
    return {"flush": out}


def recovery_runs(r: Doc) -> dict[str, list[Doc]]:
    """The runs of each system that ran."""
    return {
        s: [x for x in r["runs"] if x["system"] == s]
        for s in r["systems"]
        if any(x["system"] == s for x in r["runs"])
    }


def recovery(doc: Doc) -> dict[str, list[str]]:
    """Section ``recovery``: per system, the split of the recovery, every run, the costs."""
    r = doc["result"]
    runs = recovery_runs(r)
    out = [
        f"- model: `examples/train_gpt.py` default size ({fmt(r['params_m'])} M parameters), 2 ranks "
        f"(gloo) on one node, {r['steps']} steps; failure-free step time {fmt(r['ref_step_time'], '.3f')} s",
        f"- rank {1} SIGKILLs itself right after step {r['fail_step']}; torchrun + DCP checkpoints every "
        f"{r['dcp_every']} steps; median (min-max) over the runs",
        "",
        "```",
        *[f"# {k}: {v}" for k, v in r["commands"].items()],
        "```",
        "",
    ]
    rows = []
    for s, xs in runs.items():
        detect_on = [
            x["death_to_resumed_s"] - (x["phases"].get("detect") or 0)
            if x["death_to_resumed_s"] is not None
            else None
            for x in xs
        ]
        rows.append(
            [
                s,
                stat([x["death_to_resumed_s"] for x in xs], ".2f", " s"),
                stat(detect_on, ".2f", " s"),
                stat([x["steps_lost"] for x in xs], ".0f"),
                stat([x["step_time_s"] for x in xs], ".3f", " s"),
                stat([x["time_lost_s"] for x in xs], ".2f", " s"),
                f"{sum(x['digest_ok'] for x in xs)}/{len(xs)}",
            ]
        )
    head = [
        "system",
        "rank death -> all ranks stepping",
        "detect -> stepping",
        "steps lost",
        "step time",
    ]
    out += table([*head, "time lost", "final digest ok"], rows)
    ph = [
        [k, *[stat([x["phases"].get(k) for x in xs]) for xs in runs.values()]]
        for k in r["phase_names"]
    ]
    ph.append(
        [
            "spawn+import (within start/script)",
            *[stat([x["spawn_import_s"] for x in xs]) for xs in runs.values()],
        ]
    )
    out += [
        "Split of rank death -> all ranks stepping (seconds):",
        "",
        *table(["phase", *runs], ph),
    ]
    every = [
        [
            f"{x['system']} #{x['repeat']}",
            fmt(x["load1"]),
            fmt(x["death_to_resumed_s"], ".2f", " s"),
            fmt(x["spawn_import_s"], ".2f", " s"),
            fmt(x["step_time_s"], ".3f", " s"),
            x["restored"],
            fmt(x["time_lost_s"], ".2f", " s"),
            "ok" if x["digest_ok"] else "DIFFERS",
            x["error"] or "-",
        ]
        for x in r["runs"]
    ]
    head = [
        "run",
        "load avg at start",
        "death -> stepping",
        "spawn+import",
        "step time",
        "restored",
    ]
    out += [
        "Every run, in the order run:",
        "",
        *table([*head, "time lost", "digest", "error"], every),
    ]
    dc = runs.get("torchrun + DCP", [])
    sb = runs.get("ftmem-launch + standbys", [])
    cost = [
        [
            "torchrun + DCP: `dcp.save` blocking per checkpoint and rank",
            stat([c for x in dc for c in x["checkpoint_s"]], ".3f", " s"),
        ],
        [
            "torchrun + DCP: `dcp.load` + `set_state_dict` per rank",
            stat([c for x in dc for c in x["load_s"]], ".3f", " s"),
        ],
        [
            "standbys' warm-ups: training time lost per run",
            stat([x["warmup_extra_s"] for x in sb], ".2f", " s"),
        ],
    ]
    if sb_cost := r.get("standby"):
        cost += [
            [
                "one standby: warm-up wall / CPU",
                f"{sb_cost['warm_up_s']:.1f} s / {sb_cost['cpu_s']:.1f} CPU-s",
            ],
            [
                "one standby: RSS / USS",
                f"{sb_cost['rss_mib']:.0f} MiB / {sb_cost['uss_mib']:.0f} MiB",
            ],
            ["one standby: CPU in 2 s of waiting", f"{sb_cost['idle_cpu_s']:.3f} CPU-s"],
        ]
    return {"recovery": [*out, *table(["cost", "figure"], cost)]}


def ec_step(x: Doc) -> float | None:
    """A run's step time: the median over its ranks of each rank's median step time."""
    return st.median(x["rank_median"].values())


def ec_pairs(r: Doc, a: str, b: str) -> list[float]:
    """Step-time ratios ``b / a`` of runs of the same repeat."""
    by = {(x["config"], x["repeat"]): x for x in r["runs"] if x["ok"]}
    return [
        q
        for (c, k), x in by.items()
        if c == b and (a, k) in by and (q := st.ratio(ec_step(x), ec_step(by[(a, k)]))) is not None
    ]


def ec_overhead(doc: Doc) -> dict[str, list[str]]:
    """Section ``ec-overhead``: per configuration, protection counters, every run."""
    r = doc["result"]
    out = [
        f"- job: {r['nodes']} `ftmem-launch` agents x 1 rank on 127.0.0.1, `{' '.join(r['example_args'])}`; "
        "configs: no ftmem (`--no-ftmem`), off (`--ftmem-ec-parity 0`), on (`--ftmem-ec-parity 1 --ftmem-ec-interval 0`)",
        "",
    ]
    ok = [x for x in r["runs"] if x["ok"]]
    rows = []
    for c in ("no ftmem", "off", "on"):
        xs = [x for x in ok if x["config"] == c]
        if not xs:
            continue
        ftmem = c != "no ftmem"
        rows.append(
            [
                c,
                stat([ec_step(x) for x in xs], ".4f", " s"),
                stat(ec_pairs(r, "off", c), ".3f") if c == "on" else ("1" if c == "off" else "-"),
                stat(ec_pairs(r, "no ftmem", c), ".3f") if ftmem else "1",
                stat([st.median(x["smp_cpu_s"].values()) for x in xs], ".1f", " s")
                if ftmem
                else "-",
                stat([st.median(x["log_commits"].values()) for x in xs], ".0f") if ftmem else "-",
                stat([sum(x["skipped"].values()) for x in xs], ".0f") if ftmem else "-",
            ]
        )
    head = [
        "config",
        "step time",
        "vs off (per pair)",
        "vs no ftmem (per pair)",
        "SMP CPU per node",
    ]
    out += table(
        [*head, "snapshots committed per node (events)", "skipped (all ranks, STATUS)"], rows
    )
    on = [x for x in ok if x["config"] == "on"]
    if on:
        first = [{k: v.get("0", v.get(0)) for k, v in x.items() if isinstance(v, dict)} for x in on]
        prot = [
            [
                "rounds done (STATUS `counters.protected`, node 0, last poll)",
                stat([f["status_rounds"] for f in first], ".0f"),
            ],
            [
                "rounds done (SMP events, node 0)",
                stat([len(f["log_rounds"] or []) for f in first], ".0f"),
            ],
            [
                "time per round (every round of every node)",
                stat([t for x in on for v in x["log_rounds"].values() for t in v], ".3f", " s"),
            ],
            ["own bytes per node", mib(st.finite(f["own_bytes"] for f in first))],
            ["parity bytes held per node", mib(st.finite(f["parity_bytes"] for f in first))],
            [
                "peer bytes sent per node (whole run)",
                mib(st.finite(f["sent_bytes"] for f in first)),
            ],
        ]
        out += table(["protection ('on' runs)", "median (min-max) over runs"], prot)
    every = [
        [
            x["repeat"],
            x["config"],
            fmt(x["load_start"]),
            ", ".join(fmt(v, ".4f") for v in x["rank_median"].values()),
            ", ".join(fmt(v, ".4f") for v in x["rank_mean"].values()),
            ", ".join(
                f"{x['status_rounds'].get(k, '-')}/{len(v)}" for k, v in x["log_rounds"].items()
            )
            or "-",
            ", ".join(fmt(v, ".1f") for v in x["smp_cpu_s"].values()) or "-",
            f"{x['wall_s']:.0f} s",
            x["error"] or "ok",
        ]
        for x in r["runs"]
    ]
    head = [
        "repeat",
        "config",
        "load",
        "median step (ranks)",
        "mean step (ranks)",
        "rounds status/events per node",
    ]
    return {"ec-overhead": [*out, *table([*head, "SMP CPU s per node", "wall", "status"], every)]}
