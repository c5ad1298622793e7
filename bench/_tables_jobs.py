"""The tables of the parts that run training jobs (overhead, recovery, flush, EC overhead).

Used by ``bench/_tables.py``'s ``BODIES``; figures only, from the parts' results JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench import _stats as st
from bench._stats import GiB, MiB, fmt, stat
from bench._tables_base import Doc, columns, kv, mib, table

Columns = list[tuple[str, Callable[[Any], Any]]]


def _ranks(x: Doc, key: str, spec: str = ".4f") -> str:
    """One figure of every rank (or node) of a run, comma-separated."""
    return ", ".join(fmt(v, spec) for v in x[key].values())


def _unless(cond: bool, value: Callable[[], str], other: str = "-") -> str:
    return other if cond else value()


def _overhead_columns(r: Doc) -> Columns:
    floor = "0 (the floor)"
    return [
        ("configuration", lambda c: c),
        ("time per step", lambda c: stat(r["step_s"][c], ".4f", " s")),
        (
            "overhead vs none (wall)",
            lambda c: _unless(c == "none", lambda: st.pct(r["ratio"].get(c, [])), floor),
        ),
        (
            "rank CPU vs none",
            lambda c: _unless(c == "none", lambda: st.pct(r["cpu_ratio"].get(c, [])), floor),
        ),
        ("rank CPU per step", lambda c: stat(r["cpu_s"][c], ".4f", " s")),
        (
            "snapshots per cycle",
            lambda c: _unless(c.startswith("none"), lambda: stat(r["saves"][c], ".0f")),
        ),
        (
            "skipped per cycle",
            lambda c: _unless(not c.startswith("ftmem"), lambda: stat(r["skipped"][c], ".0f")),
        ),
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
    return [
        ("repeat", lambda i: i),
        ("order", lambda i: " > ".join(r["orders"][i])),
        ("dcp.save", lambda i: fmt(r["per_repeat"][i].get(_DCP), ".2f", " s")),
        ("export_dcp", lambda i: fmt(r["per_repeat"][i].get(_EXP), ".2f", " s")),
        ("export/dcp throughput", lambda i: _flush_ratio(r["per_repeat"][i], _EXP)),
        (
            "FLUSH (request to reply; SMP's own figure)",
            lambda i: (
                f"{fmt(r['per_repeat'][i].get(_FL), '.2f', ' s')}; "
                f"{fmt(r['per_repeat'][i].get('flush_smp_s'), '.2f', ' s')}"
            ),
        ),
        ("FLUSH/dcp throughput", lambda i: _flush_ratio(r["per_repeat"][i], _FL)),
    ]


def _flush_ratio(row: Doc, system: str) -> str:
    return fmt(st.ratio(row.get(_DCP), row.get(system)), ".2f", "x")


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


def _flush_train_columns(t: Doc) -> Columns:
    def fl(f: Callable[[list[Doc]], str]) -> Callable[[tuple[str, list[Doc]]], str]:
        return lambda cx: "-" if cx[0] == "no flush" else f(cx[1])

    return [
        ("config", lambda cx: cx[0]),
        ("step time", lambda cx: stat([t["step"][id(x)] for x in cx[1]], ".4f", " s")),
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
            fl(lambda xs: stat(st.scale([t["share"](x) for x in xs], 100), ".0f", "%")),
        ),
        ("snapshots skipped", lambda cx: stat([sum(x["skipped"].values()) for x in cx[1]], ".0f")),
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
    (
        "rank death -> all ranks stepping",
        lambda sx: stat([x["death_to_resumed_s"] for x in sx[1]], ".2f", " s"),
    ),
    ("detect -> stepping", lambda sx: stat([_detect_on(x) for x in sx[1]], ".2f", " s")),
    ("steps lost", lambda sx: stat([x["steps_lost"] for x in sx[1]], ".0f")),
    ("step time", lambda sx: stat([x["step_time_s"] for x in sx[1]], ".3f", " s")),
    ("time lost", lambda sx: stat([x["time_lost_s"] for x in sx[1]], ".2f", " s")),
    ("final digest ok", lambda sx: f"{sum(x['digest_ok'] for x in sx[1])}/{len(sx[1])}"),
]
RECOVERY_RUNS: Columns = [
    ("run", lambda x: f"{x['system']} #{x['repeat']}"),
    ("load avg at start", lambda x: fmt(x["load1"])),
    ("death -> stepping", lambda x: fmt(x["death_to_resumed_s"], ".2f", " s")),
    ("spawn+import", lambda x: fmt(x["spawn_import_s"], ".2f", " s")),
    ("step time", lambda x: fmt(x["step_time_s"], ".3f", " s")),
    ("restored", lambda x: x["restored"]),
    ("time lost", lambda x: fmt(x["time_lost_s"], ".2f", " s")),
    ("digest", lambda x: "ok" if x["digest_ok"] else "DIFFERS"),
    ("error", lambda x: x["error"] or "-"),
]


def _recovery_costs(r: Doc, runs: dict[str, list[Doc]]) -> list[list[str]]:
    dc, sb = runs.get("torchrun + DCP", []), runs.get("ftmem-launch + standbys", [])
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


def _ec_config_columns(r: Doc) -> Columns:
    def ft(f: Callable[[list[Doc]], str]) -> Callable[[tuple[str, list[Doc]]], str]:
        return lambda cx: "-" if cx[0] == "no ftmem" else f(cx[1])

    def vs_off(c: str) -> str:
        return stat(ec_pairs(r, "off", c), ".3f") if c == "on" else ("1" if c == "off" else "-")

    return [
        ("config", lambda cx: cx[0]),
        ("step time", lambda cx: stat([ec_step(x) for x in cx[1]], ".4f", " s")),
        ("vs off (per pair)", lambda cx: vs_off(cx[0])),
        (
            "vs no ftmem (per pair)",
            lambda cx: "1" if cx[0] == "no ftmem" else stat(ec_pairs(r, "no ftmem", cx[0]), ".3f"),
        ),
        (
            "SMP CPU per node",
            ft(lambda xs: stat([st.median(x["smp_cpu_s"].values()) for x in xs], ".1f", " s")),
        ),
        (
            "snapshots committed per node (events)",
            ft(lambda xs: stat([st.median(x["log_commits"].values()) for x in xs], ".0f")),
        ),
        (
            "skipped (all ranks, STATUS)",
            ft(lambda xs: stat([sum(x["skipped"].values()) for x in xs], ".0f")),
        ),
    ]


def _ec_rounds(x: Doc) -> str:
    return (
        ", ".join(f"{x['status_rounds'].get(k, '-')}/{len(v)}" for k, v in x["log_rounds"].items())
        or "-"
    )


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
    return [
        [
            "rounds done (STATUS `counters.protected`, node 0, last poll)",
            stat([f["status_rounds"] for f in first], ".0f"),
        ],
        [
            "rounds done (SMP events, node 0)",
            stat([len(f["log_rounds"] or []) for f in first], ".0f"),
        ],
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
