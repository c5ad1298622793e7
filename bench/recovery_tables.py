"""The ``recovery`` section of docs/benchmarks.md and its goals, rendered from the results JSON
of ``bench/recovery.py``: per system the time from rank death to all ranks stepping, its split
into phases, every run, and the costs (DCP's save and load, the standbys); the goals compare
the time lost per failure with torchrun + DCP. Nothing here measures: ``bench/_render.py``
calls ``sections(result)`` and ``goals(result)``.
"""

from __future__ import annotations

from typing import Any

from bench._figures import Fig, Goal, figs, groups, kv, le, rows, table
from bench._stats import fmt, median, ratio, stat
from bench.recovery import (
    DCP,
    EARLY_PART,
    FAIL_RANK,
    FT_FORK,
    FT_INPROC,
    FT_STANDBY,
    PART,
    Run,
    early_failure,
)


def _detect_on(x: dict[str, Any]) -> float | None:
    d = x["death_to_resumed_s"]
    return None if d is None else d - (x["phases"].get("detect") or 0)


SYSTEMS_TABLE = [
    Fig("rank death -> all ranks stepping", ".2f", " s", "death_to_resumed_s", "stat"),
    Fig("detect -> stepping", ".2f", " s", _detect_on, "stat"),
    Fig("steps lost", ".0f", "", "steps_lost", "stat"),
    Fig("step time", ".3f", " s", "step_time_s", "stat"),
    Fig("time lost", ".2f", " s", "time_lost_s", "stat"),
    Fig("final digest ok", get=lambda sx: f"{sum(x['digest_ok'] for x in sx[1])}/{len(sx[1])}"),
]
RUNS_TABLE = [
    Fig("run", get=lambda x: f"{x['system']} #{x['repeat']}"),
    *figs(Run, "load1", "death_to_resumed_s", "spawn_import_s", "step_time_s", "restored"),
    *figs(Run, "time_lost_s", "digest_ok", "error"),
]


def _costs(r: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    dc = runs.get(DCP, [])
    sb = [*runs.get(FT_STANDBY, [])]
    save, load = ([c for x in dc for c in x[k]] for k in ("checkpoint_s", "load_s"))
    warmups = stat([x["warmup_extra_s"] for x in sb], ".2f", " s")
    out = [
        ["torchrun + DCP: `dcp.save` blocking per checkpoint and rank", stat(save, ".3f", " s")],
        ["torchrun + DCP: `dcp.load` + `set_state_dict` per rank", stat(load, ".3f", " s")],
        ["standbys' warm-ups (standby-fork=off): training time lost per run", warmups],
    ]
    for key, what in (("fork_server", "the fork server"), ("standby", "one standby")):
        if c := r.get(key):
            out += [
                [f"{what}: warm-up wall / CPU", f"{c['warm_up_s']:.1f} s / {c['cpu_s']:.1f} CPU-s"],
                [f"{what}: RSS / USS", f"{c['rss_mib']:.0f} MiB / {c['uss_mib']:.0f} MiB"],
                [f"{what}: CPU in 2 s of waiting", f"{c['idle_cpu_s']:.3f} CPU-s"],
            ]
    return out


def by_system(r: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The runs of each system that ran."""
    runs = {s: [x for x in r["runs"] if x["system"] == s] for s in r["systems"]}
    return {s: xs for s, xs in runs.items() if xs}


def sections(r: dict[str, Any]) -> dict[str, list[str]]:
    """Section ``recovery``: per system, the split of the recovery, every run, the costs."""
    runs = by_system(r)
    ph = [
        [k, *(stat([x["phases"].get(k) for x in xs]) for xs in runs.values())]
        for k in r["phase_names"]
    ]
    spawn = [stat([x["spawn_import_s"] for x in xs]) for xs in runs.values()]
    out = [
        f"- model: the test workload (`tests/_support/workload/train.py`) at its default size ({fmt(r['params_m'])} M parameters), 2 ranks "
        f"(gloo) on one node, {r['steps']} steps; failure-free step time {fmt(r['ref_step_time'], '.3f')} s",
        f"- rank {FAIL_RANK} SIGKILLs itself right after step {r['fail_step']}; torchrun + DCP checkpoints every "
        f"{r['dcp_every']} steps; median (min-max) over the runs",
        "",
        "```",
        *[f"# {k}: {v}" for k, v in r["commands"].items()],
        "```",
        "",
        *groups("system", SYSTEMS_TABLE, runs),
        "Split of rank death -> all ranks stepping (seconds):",
        "",
        *table(["phase", *runs], [*ph, ["spawn+import (within start/script)", *spawn]]),
        "Every run, in the order run:",
        "",
        *rows(RUNS_TABLE, r["runs"]),
        *kv(_costs(r, runs), ("cost", "figure")),
    ]
    if early_failure(r["fail_step"], r["dcp_every"]):
        sb = runs.get(FT_STANDBY, [])
        warm = sum(1 for x in sb if x.get("from_standby"))
        lead = (
            f"- a failure before torchrun + DCP's first checkpoint (every {r['dcp_every']} "
            "steps): its restart begins at step 0; ftmem-launch's fork server is warm before "
            "the first ranks start (they are forked from it), while standby ranks "
            f"(standby-fork=off) start once the ranks step: here {warm} of {len(sb)} such "
            "restarts found them ready"
        )
        return {EARLY_PART: [lead, "", *out]}
    return {PART: out}


EARLY_GOAL = ("rank death -> all ranks stepping, killed before DCP's first checkpoint", "<= 1.0 s")
"""With the shipped defaults (the fork server)."""


GOALS = (
    ("time lost per failure, ftmem-launch in process / torchrun + DCP", "<= 0.25"),
    ("rank death -> all ranks stepping, in process", "<= 1.0 s"),
    ("time lost per failure, ftmem-launch + fork server / torchrun + DCP", "<= 0.33"),
    ("rank death -> all ranks stepping, fork server", "<= 1.5 s"),
    ("detection (rank death -> detected)", "<= 0.1 s (DLRover)"),
    ("detection -> new ranks started (stop + rendezvous + start)", "<= 0.02 s (DLRover)"),
)


def goals(r: dict[str, Any] | None, part: str = PART) -> list[Goal]:
    """Time lost against torchrun + DCP, restart time (in process, fork server), detection,
    start; for ``EARLY_PART``, the fork server's restart after an early failure."""
    runs = by_system(r) if r else {}
    if part == EARLY_PART:
        fork = runs.get(FT_FORK)
        if not fork:
            return [Goal(part, *EARLY_GOAL)]
        restart = median(x["death_to_resumed_s"] for x in fork)
        ok = le(restart, 1.0)
        return [Goal(part, *EARLY_GOAL, fmt(restart, ".2f", " s"), ok, f"{part}, {len(fork)} runs")]
    ip, sb, dc = runs.get(FT_INPROC), runs.get(FT_FORK), runs.get(DCP)
    if not ip or not sb or not dc:
        return [Goal(PART, g, t) for g, t in GOALS]
    values = []
    for xs, limit_ratio, limit_s in ((ip, 1 / 4, 1.0), (sb, 1 / 3, 1.5)):
        lost = [median(x["time_lost_s"] for x in ys) for ys in (xs, dc)]
        rat = ratio(*lost)
        restart = median(x["death_to_resumed_s"] for x in xs)
        values += [
            (f"{fmt(lost[0])} s / {fmt(lost[1])} s = {fmt(rat)}", le(rat, limit_ratio)),
            (fmt(restart, ".2f", " s"), le(restart, limit_s)),
        ]
    detect = median(x["phases"].get("detect") for x in sb)
    to_start = median(
        sum(x["phases"].get(k) or 0.0 for k in ("stop", "rendezvous", "start"))
        for x in sb
        if x["phases"].get("start") is not None
    )
    values += [
        (fmt(detect, ".2f", " s"), le(detect, 0.1)),
        (fmt(to_start, ".2f", " s"), le(to_start, 0.02)),
    ]
    src = f"recovery, {len(sb)} runs per system"
    return [Goal(PART, g, t, m, ok, src) for (g, t), (m, ok) in zip(GOALS, values, strict=True)]
