"""The tables of each part's section, made from its results JSON (used by ``bench/_render.py``).

``BODIES[part](doc)`` gives, per section the part makes, the lines between the section's
head (title, command, machine) and its tail (goals, errors): column specs (header, item ->
cell) applied to one row per item. Figures only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bench import _goals
from bench import _stats as st
from bench._stats import GiB, MiB, fmt, stat

Doc = dict[str, Any]
Column = tuple[str, Callable[[Any], Any]]
Columns = list[Column]


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table (cells converted with ``str``)."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return [*out, ""]


def columns(specs: Sequence[Column], items: Iterable[Any]) -> list[str]:
    """A table with one row per item: each column is (header, item -> cell)."""
    return table([h for h, _ in specs], [[f(x) for _, f in specs] for x in items])


def kv(rows: Iterable[Sequence[Any]], head: Sequence[str] = ("figure", "value")) -> list[str]:
    """A two-column table of (label, value) rows."""
    return table(head, rows)


def mib(values: Sequence[float]) -> str:
    """``median (min-max)`` in MiB."""
    return stat(st.scale(values, 1 / MiB), ".0f", " MiB")


def one(key: str, spec: str = ".2f", unit: str = "") -> Callable[[Doc], str]:
    """A column: ``x[key]`` of each row, formatted."""
    return lambda x: fmt(x[key], spec, unit)


def over(get: str | Callable[[Doc], Any], spec: str = ".2f", unit: str = "") -> Callable:
    """A column of (name, items) rows: ``stat`` of ``x[get]`` (or ``get(x)``) over the items."""
    f = (lambda x: x[get]) if isinstance(get, str) else get
    return lambda nx: stat([f(x) for x in nx[1]], spec, unit)


# ------------------------------------------------------------------------------ training jobs


def job_step(x: Doc) -> float | None:
    """A training job's step time: the median over its ranks of each rank's median."""
    return st.median(x["rank_median"].values())


def pair_ratios(runs: list[Doc], a: str, b: str) -> list[float]:
    """Step-time ratios config ``b`` / config ``a`` of the ok runs of the same repeat."""
    by = {(x["config"], x["repeat"]): x for x in runs if x["ok"]}
    pairs = [(x, by.get((a, k))) for (c, k), x in by.items() if c == b]
    return [q for x, y in pairs if y and (q := st.ratio(job_step(x), job_step(y))) is not None]


def _ranks(x: Doc, key: str, spec: str = ".4f") -> str:
    """One figure of every rank (or node) of a run, comma-separated."""
    return ", ".join(fmt(v, spec) for v in x[key].values())


def _unless(cond: bool, value: Callable[[], str], other: str = "-") -> str:
    return other if cond else value()


def _overhead_columns(r: Doc) -> Columns:
    def vs_none(key: str) -> Callable[[str], str]:
        return lambda c: _unless(c == "none", lambda: st.pct(r[key].get(c, [])), "0 (the floor)")

    def count(key: str, skip: Callable[[str], bool]) -> Callable[[str], str]:
        return lambda c: _unless(skip(c), lambda: stat(r[key][c], ".0f"))

    return [
        ("configuration", lambda c: c),
        ("time per step", lambda c: stat(r["step_s"][c], ".4f", " s")),
        ("overhead vs none (wall)", vs_none("ratio")),
        ("rank CPU vs none", vs_none("cpu_ratio")),
        ("rank CPU per step", lambda c: stat(r["cpu_s"][c], ".4f", " s")),
        ("snapshots per cycle", count("saves", lambda c: c.startswith("none"))),
        ("skipped per cycle", count("skipped", lambda c: not c.startswith("ftmem"))),
    ]


OVERHEAD_BLOCKS: Columns = [
    ("cycle", lambda b: b["cycle"]),
    ("configuration", lambda b: b["config"]),
    ("time per step", lambda b: f"{b['seconds'] / b['steps']:.4f} s"),
    ("rank CPU per step", lambda b: f"{b['cpu_s'] / b['steps']:.4f} s"),
    ("snapshots", lambda b: b["saves"]),
    ("skipped", lambda b: b["skipped"]),
]


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
        *columns(_overhead_columns(r), r["step_s"]),
        "<details><summary>Every block, in the order run</summary>",
        "",
        *columns(OVERHEAD_BLOCKS, r["blocks"]),
    ]
    return {"overhead": [*out, "</details>", ""]}


FLUSH_SYSTEMS = ("ftmem export_dcp", "ftmem FLUSH (SMP worker)", "dcp.save", "torch.save")
_DCP, _EXP, _FL = "dcp.save", "ftmem export_dcp", "ftmem FLUSH (SMP worker)"


def _flush_columns(r: Doc) -> Columns:
    return [
        ("system", lambda s: s),
        ("time", lambda s: stat(r["times"][s], ".2f", " s")),
        ("throughput", lambda s: stat(st.gbps(r["nbytes"], r["times"][s]), ".3f", " GB/s")),
        ("CPU s (writer process)", lambda s: stat(r["cpu"].get(s, []), ".2f")),
        ("minor page faults", lambda s: stat(st.scale(r["faults"].get(s, []), 1e-3), ".0f", " k")),
        ("peak memory added (RssAnon)", lambda s: mib(r["mem"].get(s, []))),
        ("on disk", lambda s: f"{r['disk_bytes'].get(s, 0) / MiB:.0f} MiB"),
    ]


def _flush_repeats(r: Doc) -> Columns:
    def sec(i: int, key: str) -> str:
        return fmt(r["per_repeat"][i].get(key), ".2f", " s")

    def vs_dcp(system: str) -> Callable[[int], str]:
        row = r["per_repeat"]
        return lambda i: fmt(st.ratio(row[i].get(_DCP), row[i].get(system)), ".2f", "x")

    return [
        ("repeat", lambda i: i),
        ("order", lambda i: " > ".join(r["orders"][i])),
        ("dcp.save", lambda i: sec(i, _DCP)),
        ("export_dcp", lambda i: sec(i, _EXP)),
        ("export/dcp throughput", vs_dcp(_EXP)),
        (
            "FLUSH (request to reply; SMP's own figure)",
            lambda i: f"{sec(i, _FL)}; {sec(i, 'flush_smp_s')}",
        ),
        ("FLUSH/dcp throughput", vs_dcp(_FL)),
    ]


def _flush_size(r: Doc) -> list[str]:
    out = [f"#### {r['nbytes'] / GiB:.2f} GiB state (requested {r['size_gib']:g} GiB)", ""]
    out += columns(_flush_columns(r), [s for s in FLUSH_SYSTEMS if s in r["times"]])
    out += columns(_flush_repeats(r), range(len(r["per_repeat"])))
    if r["phases"]:
        total = st.median(r["times"][_EXP])
        ph = [
            [k, stat(v, ".3f", " s"), fmt(st.ratio(st.median(v), total), ".0%")]
            for k, v in r["phases"].items()
        ]
        ph.append(["export_dcp's own dcp.save: CPU s", stat(r["inner_cpu"]), "-"])
        faults = stat(st.scale(r["inner_faults"], 1e-3), ".0f", " k")
        ph.append(["export_dcp's own dcp.save: minor page faults", faults, "-"])
        out += table(["phase of export_dcp", "time", "share"], ph)
    out += kv([[k, fmt(v, ".2f")] for k, v in r["once"].items()], ("one-off figure", "seconds"))
    return out + [f"- {n}" for n in r["notes"]] + ([""] if r["notes"] else [])


def flush_train(r: Doc) -> dict[str, Any]:
    """Figures of the training runs: per config, and the flush/no-flush ratios of pairs."""
    ok = [x for x in r["train"] if x["ok"]]
    by = {c: [x for x in ok if x["config"] == c] for c in ("no flush", "flush every 5")}
    by["flush every 5"] = [x for x in ok if x["config"] != "no flush"]

    def during(x: Doc) -> list[Any]:
        return [f for f in x["flushes"] if x["train_end"] is not None and f[0] <= x["train_end"]]

    def share(x: Doc) -> float | None:
        span = (x["train_end"] or 0) - (x["train_start"] or 0)
        return sum(f[2] for f in during(x)) / span if span > 0 else None

    ratios = pair_ratios(r["train"], "no flush", "flush every 5")
    return {"by": by, "ratios": ratios, "during": during, "share": share}


def _flush_train_columns(t: Doc) -> Columns:
    def fl(f: Callable[[list[Doc]], str]) -> Callable[[tuple[str, list[Doc]]], str]:
        return lambda cx: "-" if cx[0] == "no flush" else f(cx[1])

    return [
        ("config", lambda cx: cx[0]),
        ("step time", over(job_step, ".4f", " s")),
        (
            "vs no flush (per pair)",
            lambda cx: "1" if cx[0] == "no flush" else stat(t["ratios"], ".3f"),
        ),
        ("flushes during training", fl(lambda xs: stat([len(t["during"](x)) for x in xs], ".0f"))),
        ("flushes in all", fl(lambda xs: stat([len(x["flushes"]) for x in xs], ".0f"))),
        (
            "seconds per flush",
            fl(lambda xs: stat([f[2] for x in xs for f in x["flushes"]], ".2f", " s")),
        ),
        (
            "flushing's share of training",
            fl(lambda xs: stat(st.scale(map(t["share"], xs), 100), ".0f", "%")),
        ),
        ("snapshots skipped", over(lambda x: sum(x["skipped"].values()), ".0f")),
    ]


def _flushed_steps(x: Doc) -> str:
    after = x["train_end"]
    return " ".join(f"{f[1]}{'*' if after and f[0] > after else ''}" for f in x["flushes"]) or "-"


FLUSH_RUNS: Columns = [
    ("repeat", lambda x: x["repeat"]),
    ("config", lambda x: x["config"]),
    ("load", lambda x: fmt(x["load_start"])),
    ("median step (ranks)", lambda x: _ranks(x, "rank_median")),
    ("mean step (ranks)", lambda x: _ranks(x, "rank_mean")),
    ("flushed steps (* = after the last step)", _flushed_steps),
    ("STATUS flushes / skipped", lambda x: f"{x['status_flushes']} / {sum(x['skipped'].values())}"),
    ("wall", lambda x: f"{x['wall_s']:.0f} s"),
    ("status", lambda x: x["error"] or "; ".join(x["failed"]) or "ok"),
]


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
        *columns(_flush_train_columns(t), t["by"].items()),
        *columns(FLUSH_RUNS, r["train"]),
    ]
    return {"flush": out}


def recovery_runs(r: Doc) -> dict[str, list[Doc]]:
    """The runs of each system that ran."""
    return {
        s: [x for x in r["runs"] if x["system"] == s]
        for s in r["systems"]
        if any(x["system"] == s for x in r["runs"])
    }


def _detect_on(x: Doc) -> float | None:
    d = x["death_to_resumed_s"]
    return None if d is None else d - (x["phases"].get("detect") or 0)


RECOVERY_SYSTEMS: Columns = [
    ("system", lambda sx: sx[0]),
    ("rank death -> all ranks stepping", over("death_to_resumed_s", ".2f", " s")),
    ("detect -> stepping", over(_detect_on, ".2f", " s")),
    ("steps lost", over("steps_lost", ".0f")),
    ("step time", over("step_time_s", ".3f", " s")),
    ("time lost", over("time_lost_s", ".2f", " s")),
    ("final digest ok", lambda sx: f"{sum(x['digest_ok'] for x in sx[1])}/{len(sx[1])}"),
]
RECOVERY_RUNS: Columns = [
    ("run", lambda x: f"{x['system']} #{x['repeat']}"),
    ("load avg at start", one("load1")),
    ("death -> stepping", one("death_to_resumed_s", ".2f", " s")),
    ("spawn+import", one("spawn_import_s", ".2f", " s")),
    ("step time", one("step_time_s", ".3f", " s")),
    ("restored", lambda x: x["restored"]),
    ("time lost", one("time_lost_s", ".2f", " s")),
    ("digest", lambda x: "ok" if x["digest_ok"] else "DIFFERS"),
    ("error", lambda x: x["error"] or "-"),
]


def _recovery_costs(r: Doc, runs: dict[str, list[Doc]]) -> list[list[str]]:
    dc, sb = runs.get("torchrun + DCP", []), runs.get("ftmem-launch + standbys", [])
    dcp_save, dcp_load = ([c for x in dc for c in x[k]] for k in ("checkpoint_s", "load_s"))
    cost = [
        [
            "torchrun + DCP: `dcp.save` blocking per checkpoint and rank",
            stat(dcp_save, ".3f", " s"),
        ],
        ["torchrun + DCP: `dcp.load` + `set_state_dict` per rank", stat(dcp_load, ".3f", " s")],
        [
            "standbys' warm-ups: training time lost per run",
            stat([x["warmup_extra_s"] for x in sb], ".2f", " s"),
        ],
    ]
    if c := r.get("standby"):
        cost += [
            ["one standby: warm-up wall / CPU", f"{c['warm_up_s']:.1f} s / {c['cpu_s']:.1f} CPU-s"],
            ["one standby: RSS / USS", f"{c['rss_mib']:.0f} MiB / {c['uss_mib']:.0f} MiB"],
            ["one standby: CPU in 2 s of waiting", f"{c['idle_cpu_s']:.3f} CPU-s"],
        ]
    return cost


def recovery(doc: Doc) -> dict[str, list[str]]:
    """Section ``recovery``: per system, the split of the recovery, every run, the costs."""
    r = doc["result"]
    runs = recovery_runs(r)
    ph = [
        [k, *[stat([x["phases"].get(k) for x in xs]) for xs in runs.values()]]
        for k in r["phase_names"]
    ]
    spawn = [stat([x["spawn_import_s"] for x in xs]) for xs in runs.values()]
    ph.append(["spawn+import (within start/script)", *spawn])
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
        *columns(RECOVERY_SYSTEMS, runs.items()),
        "Split of rank death -> all ranks stepping (seconds):",
        "",
        *table(["phase", *runs], ph),
        "Every run, in the order run:",
        "",
        *columns(RECOVERY_RUNS, r["runs"]),
    ]
    return {"recovery": [*out, *kv(_recovery_costs(r, runs), ("cost", "figure"))]}


def _ec_config_columns(r: Doc) -> Columns:
    def ft(f: Callable[[Any], str]) -> Callable[[tuple[str, list[Doc]]], str]:
        return lambda cx: "-" if cx[0] == "no ftmem" else f(cx)

    def vs(a: str, c: str) -> str:
        return stat(pair_ratios(r["runs"], a, c), ".3f")

    def vs_off(c: str) -> str:
        return vs("off", c) if c == "on" else ("1" if c == "off" else "-")

    def node_median(key: str) -> Callable[[Doc], float | None]:
        return lambda x: st.median(x[key].values())

    return [
        ("config", lambda cx: cx[0]),
        ("step time", over(job_step, ".4f", " s")),
        ("vs off (per pair)", lambda cx: vs_off(cx[0])),
        (
            "vs no ftmem (per pair)",
            lambda cx: "1" if cx[0] == "no ftmem" else vs("no ftmem", cx[0]),
        ),
        ("SMP CPU per node", ft(over(node_median("smp_cpu_s"), ".1f", " s"))),
        ("snapshots committed per node (events)", ft(over(node_median("log_commits"), ".0f"))),
        ("skipped (all ranks, STATUS)", ft(over(lambda x: sum(x["skipped"].values()), ".0f"))),
    ]


def _ec_rounds(x: Doc) -> str:
    rounds = [f"{x['status_rounds'].get(k, '-')}/{len(v)}" for k, v in x["log_rounds"].items()]
    return ", ".join(rounds) or "-"


EC_RUNS: Columns = [
    ("repeat", lambda x: x["repeat"]),
    ("config", lambda x: x["config"]),
    ("load", lambda x: fmt(x["load_start"])),
    ("median step (ranks)", lambda x: _ranks(x, "rank_median")),
    ("mean step (ranks)", lambda x: _ranks(x, "rank_mean")),
    ("rounds status/events per node", _ec_rounds),
    ("SMP CPU s per node", lambda x: _ranks(x, "smp_cpu_s", ".1f") or "-"),
    ("wall", lambda x: f"{x['wall_s']:.0f} s"),
    ("status", lambda x: x["error"] or "ok"),
]


def _ec_protection(on: list[Doc]) -> list[list[str]]:
    first = [{k: v.get("0", v.get(0)) for k, v in x.items() if isinstance(v, dict)} for x in on]
    rounds = [t for x in on for v in x["log_rounds"].values() for t in v]
    status, events = (
        [f["status_rounds"] for f in first],
        [len(f["log_rounds"] or []) for f in first],
    )
    return [
        ["rounds done (STATUS `counters.protected`, node 0, last poll)", stat(status, ".0f")],
        ["rounds done (SMP events, node 0)", stat(events, ".0f")],
        ["time per round (every round of every node)", stat(rounds, ".3f", " s")],
        ["own bytes per node", mib(st.finite(f["own_bytes"] for f in first))],
        ["parity bytes held per node", mib(st.finite(f["parity_bytes"] for f in first))],
        ["peer bytes sent per node (whole run)", mib(st.finite(f["sent_bytes"] for f in first))],
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
    by = {c: xs for c in ("no ftmem", "off", "on") if (xs := [x for x in ok if x["config"] == c])}
    out += columns(_ec_config_columns(r), by.items())
    if on := by.get("on"):
        out += kv(_ec_protection(on), ("protection ('on' runs)", "median (min-max) over runs"))
    return {"ec-overhead": [*out, *columns(EC_RUNS, r["runs"])]}


# ------------------------------------------------------------------------------ the other parts


def _figure_row(f: Doc, nbytes: int) -> list[str]:
    v, med = f["values"], st.median(f["values"])
    if f["unit"] == "GB/s":
        rng, per = (
            f"{fmt(st.low(v))}-{fmt(st.high(v))}",
            fmt(med and med / 1.073741824, ".2f", " GiB/s"),
        )
        return [f["system"], f["metric"], fmt(med, ".2f", " GB/s"), rng, per]
    rng = f"{fmt(st.low(v), '.4f')}-{fmt(st.high(v), '.4f')}"
    per_gib = fmt(med and med * GiB / nbytes, ".4f", " s/GiB")
    return [f["system"], f["metric"], fmt(med, ".4f", " s"), rng, per_gib]


def snapshot(doc: Doc) -> dict[str, list[str]]:
    """Sections ``snapshot`` and ``memory``."""
    r = doc["result"]
    sim = r["simulate"] == "compute"
    out = [
        f"- each figure: median of {r['repeats']} repeats, with min-max; per GiB divides the "
        "median by the state size (params + AdamW exp_avg + exp_avg_sq, fp32)",
        "- forward/backward stand-in between a save and `optimizer.step()`: "
        + (
            f"{r['fwd_bwd_s']:g} s of 256x256 matmuls on the main thread"
            if sim
            else f"time.sleep({r['fwd_bwd_s']:g})"
        ),
        "",
    ]
    for s in r["sizes"]:
        out += [f"### {s['nbytes'] / GiB:.2f} GiB state (requested {s['size_gib']:g} GiB)", ""]
        rows = [_figure_row(f, s["nbytes"]) for f in s["figures"]]
        out += table(["system", "metric", "median", "min-max", "per GiB"], rows)
        once = [
            [k, bool(v) if "skipped" in k else fmt(v, ".3f", " s")] for k, v in s["once"].items()
        ]
        once += [
            ["ftmem restore check (clobber a weight and a moment, load, compare)", s["restore_ok"]],
            ["ftmem timed snapshots skipped or not committed", s["skipped"]],
        ]
        out += kv(once, ("one-off figure", "value"))
        if s["stats_after"]:
            out += [f"`ftmem.stats()` after the last save: `{s['stats_after']}`", ""]
    mem = {**doc, "result": {**r, "sizes": [s["memory"] for s in r["sizes"] if s.get("memory")]}}
    return {"snapshot": out, "memory": memory(mem)["memory"]}


def _x_state(values: Sequence[float], n: int) -> str:
    return f"{mib(values)} ({stat(st.scale(values, 1 / n), '.2f', 'x')})"


def _node_total(m: Doc) -> list[float]:
    return [sum(x) for x in zip(m["shm"], m["smp_anon"], m["rank_anon_added"], strict=True)]


MEMORY_COLUMNS: list[tuple[str, Callable[[Doc], Any]]] = [
    ("state", lambda m: f"{m['state_bytes'] / GiB:.2f} GiB"),
    ("slots per rank", lambda m: m["slots"]),
    ("shared memory (x state)", lambda m: _x_state(m["shm"], m["state_bytes"])),
    ("SMP RSS", lambda m: mib(m["smp_rss"])),
    ("SMP RssShmem", lambda m: mib(m["smp_shmem"])),
    ("SMP RssAnon", lambda m: mib(m["smp_anon"])),
    ("rank RssAnon added", lambda m: mib(m["rank_anon_added"])),
    ("memory per node (x state)", lambda m: _x_state(_node_total(m), m["state_bytes"])),
]


def memory(doc: Doc) -> dict[str, list[str]]:
    """Section ``memory``: one row per state size."""
    out = [
        "- one rank (this process) snapshots the benchmark state into an SMP; read after every "
        "committed snapshot once both slots hold one; median (min-max) over those readings",
        "- memory per node = shared memory (/dev/shm) + SMP RssAnon + the rank's added RssAnon",
        "",
    ]
    return {"memory": out + columns(MEMORY_COLUMNS, doc["result"]["sizes"])}


_DCP_ASYNC = "dcp.async_save (async staging)"
HEADLINE = (
    (
        "torch.save (disk, fsync)",
        ("torch.save", "disk+fsync"),
        ("torch.load", "+ load_state_dict (/dev/shm)"),
    ),
    ("dcp.save (disk, fsync)", ("dcp.save", "disk+fsync"), ("dcp.load", "in place (/dev/shm)")),
    ("dcp.async_save, tuned: blocking call", (_DCP_ASYNC, "blocking"), None),
    ("dcp.async_save, tuned: + staging wait", (_DCP_ASYNC, "stall with fence"), None),
    (
        "**ftmem** (save + fence; load in place)",
        ("ftmem", "stall (save + fence)"),
        ("ftmem", "load in place"),
    ),
)


def headline(docs: dict[str, Doc]) -> list[str]:
    """The summary's headline table: stall and restore per GiB on the largest state."""
    big = _goals.largest(docs.get("snapshot"))
    if big is None:
        return []
    n = big["nbytes"]
    rows = []
    for label, stall, restore in HEADLINE:
        s = st.per_gib(_goals.figure(big, *stall), n)
        r = st.per_gib(_goals.figure(big, *restore), n) if restore else []
        rows.append([label, stat(s, ".4f", " s/GiB"), stat(r, ".3f", " s/GiB")])
    title = f"### Headline: {n / GiB:.2f} GiB of model + AdamW state, one process"
    return [title, "", *table(["system", "stall per snapshot", "restore"], rows)]


def _wall(rows: Sequence[Doc]) -> float:
    return float(max(x["t_end"] for x in rows) - min(x["t_start"] for x in rows))


def ec_encode(c: Doc) -> list[float]:
    """Encode GB/s per SMP (wall seconds inside ``encode_stripe``), every node and repeat."""
    return [x["enc_bytes"] / x["enc_s"] / 1e9 for rows in c["protect"] for x in rows if x["enc_s"]]


def _per(rows: Sequence[Doc], key: str, den: float, spec: str = ".2f", unit: str = "x") -> str:
    """``stat`` of ``x[key] / den`` over the rows."""
    return stat([x[key] / den for x in rows], spec, unit)


def _cpu_split(rows: Sequence[Doc], gib: float) -> str:
    main = stat([x["main_cpu_s"] / gib for x in rows])
    return f"{main} / {stat([(x['cpu_s'] - x['main_cpu_s']) / gib for x in rows])}"


def _ec_case(c: Doc, size: int) -> Doc:
    """A case with its rows flattened: protect/rebuild rows and walls, busy cores, encode share."""
    prot = [x for rr in c["protect"] for x in rr]
    return {
        **c,
        "prot": prot,
        "walls": [_wall(rr) for rr in c["protect"]],
        "reb": [x for rr in c["rebuild"] for x in rr],
        "rwalls": [_wall(rr) for rr in c["rebuild"]],
        "srv": [x for rr in c["served"] for x in rr],
        "busy": [sum(x["cpu_s"] for x in rr) / _wall(rr) for rr in c["protect"]],
        "enc_share": [100 * x["enc_cpu_s"] / x["cpu_s"] for x in prot if x["cpu_s"]],
        "size": size,
        "gib": size / GiB,
    }


def _alone(c: Doc) -> str:
    return f"{c['codec_alone'][0]:.2f} ({c['codec_alone'][1]:.2f})" if c["codec_alone"] else "-"


def _gb_per(rows: Sequence[Doc], key: str) -> str:
    return stat([x["enc_bytes"] / x[key] / 1e9 for x in rows if x[key]])


EC_PROTECT = [
    ("n", lambda c: c["n"]),
    ("m", lambda c: c["m"]),
    ("protect time", lambda c: stat(c["walls"], ".2f", " s")),
    ("protected GB/s per node", lambda c: stat(st.gbps(c["size"], c["walls"]), ".3f")),
    ("group GB/s", lambda c: stat(st.gbps(c["n"] * c["size"], c["walls"]), ".3f")),
    ("encode GB/s per SMP (wall)", lambda c: stat(ec_encode(c))),
    ("encode GB/s per CPU-s", lambda c: _gb_per(c["prot"], "enc_cpu_s")),
    ("encode + gather + parity send GB/s", lambda c: _gb_per(c["prot"], "gather_s")),
    ("encode_stripe alone", _alone),
    ("node processes' cores busy", lambda c: stat(c["busy"])),
    ("machine cores busy", lambda c: stat(c["machine_busy"])),
]
EC_NODE = [
    ("n", lambda c: c["n"]),
    ("m", lambda c: c["m"]),
    ("parity held / own", lambda c: _per(c["prot"], "parity", c["size"], ".4f", "")),
    ("expected m/(n-m)", lambda c: f"{c['m'] / (c['n'] - c['m']):.4f}"),
    ("peer bytes sent / own", lambda c: _per(c["prot"], "sent", c["size"])),
    ("received / own", lambda c: _per(c["prot"], "recv", c["size"])),
    ("CPU s per GiB: protector thread / other threads", lambda c: _cpu_split(c["prot"], c["gib"])),
    ("encode share of node CPU", lambda c: stat(c["enc_share"], ".0f", " %")),
    ("peak RSS / own", lambda c: _per(c["prot"], "maxrss", c["size"])),
]
EC_REBUILD = [
    ("n", lambda c: c["n"]),
    ("m", lambda c: c["m"]),
    ("lost", lambda c: ", ".join(map(str, c["lost"]))),
    ("rebuild time", lambda c: stat(c["rwalls"], ".2f", " s")),
    ("rebuilt GB/s", lambda c: stat(st.gbps(len(c["lost"]) * c["size"], c["rwalls"]), ".3f")),
    ("fetched per new node / own", lambda c: _per(c["reb"], "recv", c["size"])),
    ("served per survivor / own", lambda c: _per(c["srv"], "sent", c["size"])),
    ("new node CPU s per GiB: protector / other", lambda c: _cpu_split(c["reb"], c["gib"])),
    ("peak RSS of a new node", lambda c: _per(c["reb"], "maxrss", GiB, ".2f", " GiB")),
    ("machine cores busy", lambda c: stat(c["machine_busy_rebuild"])),
    ("new process up + reconnected", lambda c: stat(c["rebuild_spawn_s"], ".1f", " s")),
    ("bitwise equal", lambda c: f"{sum(c['rebuild_ok'])}/{len(c['rebuild_ok'])}"),
]


def ec_protect(doc: Doc) -> dict[str, list[str]]:
    """Section ``ec-protect``: protect, per node and snapshot, rebuild."""
    r = doc["result"]
    size = r["size"]
    cases = [_ec_case(c, size) for c in r["cases"]]
    return {
        "ec-protect": [
            f"- one OS process per node on 127.0.0.1, `ZmqPeerTransport` (TCP + CURVE: libzmq {r['libzmq']}, "
            f"CURVE {'available' if r['curve'] else 'MISSING'}) and `GroupProtector` (timeout {r['timeout']:g} s), "
            f"`{r['ec_type']}`; a random snapshot of {size / MiB:g} MiB per node, stripes of {r['stripe'] / MiB:g} MiB; "
            f"median (min-max) over {r['repeats']} repeats; 'alone' = `encode_stripe` on {r['codec_bytes'] / MiB:g} MiB "
            "in a fresh process (GB/s; per CPU-s)",
            "",
            "### Protect (every node protects the same step)",
            "",
            *columns(EC_PROTECT, cases),
            "Per node and snapshot (every node and repeat):",
            "",
            *columns(EC_NODE, cases),
            "### Rebuild (lost node processes SIGKILLed; fresh ones on new ports rebuild)",
            "",
            *columns(EC_REBUILD, cases),
        ]
    }


def flatten(d: Any, prefix: str = "") -> list[list[str]]:
    """Every raw figure of a nested dict as (path, value) rows; lists of numbers as stat()."""
    if isinstance(d, dict):
        return [
            row for k, v in d.items() for row in flatten(v, f"{prefix}.{k}" if prefix else str(k))
        ]
    if (
        isinstance(d, list)
        and d
        and all(isinstance(x, int | float) and not isinstance(x, bool) for x in d)
    ):
        return [[prefix, f"{stat(d, '.4g')} (n={len(d)})"]]
    return [[prefix, f"{d:.4g}" if isinstance(d, float) else str(d)]]


DATAPATH_ROWS = (
    ("CPU: rank process per snapshotted GiB", "rank_cpu_per_gib", ".3f"),
    ("CPU: SMP process + children per snapshotted GiB", "smp_cpu_per_gib", ".3f"),
    ("CPU: total per snapshotted GiB", "total_cpu_per_gib", ".3f"),
    ("CPU: of which SMP idle housekeeping", "smp_idle_share", ".3f"),
    ("memcpy of the same bytes: CPU-s per GiB", "memcpy_cpu_per_gib", ".3f"),
    ("memcpy: GB/s (one thread)", "memcpy_gbps", ".2f"),
    ("total CPU / memcpy's", "cpu_ratio", ".2f"),
    ("stall: first save() (s)", "first_save", ".4f"),
    ("stall: save() median / max over the saves (s)", "save_med save_max", ".4f"),
    ("stall limit: 1 ms + 0.005 s/GiB (s)", "stall_limit", ".4f"),
    ("time to safe: save() to commit, median / min / max (s)", "safe_med safe_min safe_max", ".3f"),
    ("synchronous memcpy of the same bytes (s)", "memcpy_wall", ".3f"),
    ("time to safe / memcpy", "safe_ratio", ".2f"),
    ("restore in place: median (s)", "restore_med", ".3f"),
    ("restore: s/GiB", "restore_per_gib", ".3f"),
    ("restore CPU (rank + SMP) per GiB", "restore_cpu_per_gib", ".3f"),
    (
        "dcp.async_save: blocking / until staged / until written (s)",
        "dcp_blocking dcp_staged dcp_done",
        ".3f",
    ),
    ("dcp.async_save: process CPU per GiB saved", "dcp_cpu_per_gib", ".3f"),
    ("ftmem total CPU / dcp.async_save's", "ftmem_over_dcp_cpu", ".2f"),
)


def datapath(doc: Doc) -> dict[str, list[str]]:
    """Section ``datapath``: derived figures per size, the raw figures, the hash functions."""
    r = doc["result"]
    out = [
        f"- profile `{r['profile']}`: K = {r['saves']} saves, {r['repeats']} repeats of the memcpy and "
        f"the restore, compute stand-in {r['compute_ms']:g} ms, dcp.async_save {r['dcp_saves']} saves; "
        f"{r['slots']} slots per rank; loose fraction {r['loose_frac']:g}; SMP: {r['smp_note']}",
        "",
    ]
    figs = [_goals.datapath_figures(s) for s in r["sizes"] if s["data"].get("nbytes")]
    rows = [
        [label, *[" / ".join(fmt(f.get(k), spec) for k in keys.split()) for f in figs]]
        for label, keys, spec in DATAPATH_ROWS
    ]
    out += table(["figure", *[f"{f['gib']:.2f} GiB" for f in figs]], rows)
    for s in r["sizes"]:
        raw = (s["skipped"] and [["skipped", s["skipped"]]]) or flatten(s["data"])
        out += [f"<details><summary>Raw figures, {s['size_gib']:g} GiB</summary>", ""]
        out += [
            *kv([*raw, *[["note", n] for n in s["notes"]]], ("measurement", "value")),
            "</details>",
            "",
        ]
    if r["hashes"]:
        base = st.median(r["hashes"][0]["cpu"])
        hash_columns: list[tuple[str, Callable[[Doc], Any]]] = [
            ("function", lambda h: h["name"]),
            ("GB/s", lambda h: stat(st.gbps(h["bytes"], h["wall"]))),
            ("CPU-s per GiB", lambda h: stat(st.per_gib(h["cpu"], h["bytes"]), ".3f")),
            ("x memcpy", lambda h: fmt(st.ratio(st.median(h["cpu"]), base), ".2f", "x")),
        ]
        out += [
            f"### Hash functions: CPU per GiB on {r['hashes'][0]['bytes'] / MiB:.0f} MiB, one thread",
            "",
        ]
        out += columns(hash_columns, r["hashes"])
    return {"datapath": out}


def _gpu_rows(x: Doc) -> list[list[Any]]:
    n, cuda, first = x["nbytes"], x["cuda_bytes"], x["first"]
    snap = len(x["safe_s"]) * n / GiB
    skipped = f" (skipped: {first.get('reason')})" if first.get("skipped") else ""
    cpu = (
        f"{fmt(st.ratio(x['proc_cpu'], snap), '.3f')} / {fmt(st.ratio(x['smp_cpu'], snap), '.3f')}"
    )
    restore = f" = {stat(st.per_gib(x['restore_s'], n), '.3f', ' s/GiB')}"
    return [
        [
            "pinned D2H of the same tensors (side stream): the link's limit",
            stat(st.gbps(cuda, x["pinned_d2h"]), ".1f", " GB/s"),
        ],
        ["pinned H2D back", stat(st.gbps(cuda, x["pinned_h2d"]), ".1f", " GB/s")],
        ["stall: first `save()`", fmt(first.get("save_s"), ".4f", " s") + skipped],
        [f"`save()` over the {len(x['save_s'])} saves", stat(x["save_s"], ".4f", " s")],
        ["first save to commit", fmt(first.get("safe_s"), ".3f", " s")],
        [
            "D2H by ftmem: bytes / (`save()` to commit)",
            stat(st.gbps(n, x["safe_s"]), ".1f", " GB/s"),
        ],
        ["save to commit", stat(x["safe_s"], ".3f", " s")],
        ["saves skipped in save()", x["skipped"]],
        [
            "SMP verified the last step, after its commit",
            f"{fmt(x['verify_wait_s'], '.3f', ' s')} ({x['verified']})",
        ],
        ["CPU per snapshotted GiB: this process / SMP", cpu],
        ["restore (`load` in place, H2D)", stat(x["restore_s"], ".3f", " s") + restore],
        ["restore check (clobber a weight, load, compare)", x["restore_check"]],
    ]


def gpu(doc: Doc) -> dict[str, list[str]]:
    """Section ``gpu``: per size, the pinned copies, stall, D2H to commit, restore."""
    r = doc["result"]
    if r["device"] is None:
        no_cuda = f"(`torch.cuda.is_available()` is False; CUDA build {r['cuda_build']})."
        return {"gpu": [f"**skipped: no CUDA** {no_cuda}", ""]}
    out = [f"- device: {r['device']}; profile `{r['profile']}`; SMP: {r['smp_note']}", ""]
    for x in r["sizes"]:
        out += [
            f"### {x['nbytes'] / GiB:.2f} GiB state ({x['layers']}, {x['tensors']} tensors)",
            "",
        ]
        if x["error"] or x["not_run"]:
            out += [f"not measured: {x['error'] or x['not_run']}", ""]
        else:
            out += kv(_gpu_rows(x)) + [f"- {note}" for note in x["notes"]] + [""]
    return {"gpu": out}


def sharding(doc: Doc) -> dict[str, list[str]]:
    """Section ``sharding``: per D and mode, held bytes, stall, copy, restore."""
    r = doc["result"]
    out = [
        f"- state {r['size_gib']:g} GiB per rank, {r['repeats']} repeats after one warm-up, modes "
        f"alternating; compute stand-in {r['compute_s']:g} s (sleep); medians over ranks and repeats",
        "",
    ]
    rows = []
    for w in r["worlds"]:
        full = w["modes"].get("full")
        for mode, m in w["modes"].items():
            copy_vs = fmt(st.ratio(st.median(m["copy"]), full and st.median(full["copy"])))
            held_vs = fmt(st.ratio(m["held"], full and full["held"]), ".3f")
            stats = [
                stat(m[k], s, " s")
                for k, s in (("stall", ".4f"), ("copy", ".3f"), ("restore", ".3f"))
            ]
            rows.append([w["world"], mode, mib([m["held"]]), *stats, copy_vs, held_vs])
    head = [
        "D",
        "mode",
        "held per rank",
        "stall",
        "copy",
        "restore",
        "copy vs full",
        "held vs full",
    ]
    return {"sharding": out + table(head, rows)}


def ec_codec(doc: Doc) -> dict[str, list[str]]:
    """Section ``ec``: the codec's throughput (GB/s of data) per case and malloc setting."""
    r = doc["result"]
    out = [
        f"- `{r['ec_type']}`, one thread, {r['data_mib']} MiB of data per pass, median of {r['repeats']}; "
        "each case and malloc setting in a fresh interpreter",
        "",
    ]
    speeds = ("pyeclib", "encode_stripe", "encode", "rebuild")
    rows = [
        [x["n"], x["m"], f"{x['stripe_mib']} MiB", "tuned" if x["tuned"] else "default"]
        + [fmt(x[k], ".1f") for k in speeds]
        + [fmt(x["ms_per_stripe"])]
        for x in sorted(r["rows"], key=lambda x: (x["n"], x["stripe_mib"], not x["tuned"]))
    ]
    head = ["n", "m", "stripe", "malloc", "pyeclib encode", "encode_stripe (+xxh3)"]
    head += ["encode (gather k chunks)", "rebuild m lost", "ms/stripe (GIL held)"]
    return {"ec": out + table(head, rows)}


BODIES: dict[str, Callable[[Doc], dict[str, list[str]]]] = {
    "snapshot": snapshot,
    "memory": memory,
    "overhead": overhead,
    "flush": flush,
    "recovery": recovery,
    "ec-overhead": ec_overhead,
    "ec-protect": ec_protect,
    "datapath": datapath,
    "gpu": gpu,
    "sharding": sharding,
    "ec": ec_codec,
}
