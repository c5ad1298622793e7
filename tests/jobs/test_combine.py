"""``ftmem combine``: checkpoints written as the flush writes them (stock DCP plus a signed
manifest), combined by the real command; the results checked against references computed
here from the states that were saved, and loaded with stock ``dcp.load`` at 1 and 2 processes
(gloo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ftmem.cli import main as ftmem_main
from ftmem.config import ENV_TIER_KEY_FILE
from ftmem.smp.spawn import SmpProcess
from ftmem.tiers.checkpoints import checkpoint_name, read_checkpoint, write_manifest
from ftmem.tiers.combine import CombineError
from ftmem.tiers.combine_search import load_evaluator
from ftmem.tiers.dcp_meta import metadata_to_json
from ftmem.tiers.dcp_read import load_whole
from tests._support.example import example, fresh_state, load_digests, same_as_saved
from tests._support.ranks import SMALL, run_ranks

EVAL_MODULE = '''
import torch

def score(state):
    """Minus the distance of the first parameter to 0.3 * step 1's + 0.7 * step 3's."""
    w = state["model"]["tok_emb.weight"].double()
    want = torch.load(__file__.replace(".py", ".pt"), weights_only=True)
    return -float((w - want).abs().mean())
'''


@pytest.fixture
def tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tier directory, with a tier key of this test's own."""
    monkeypatch.setenv(ENV_TIER_KEY_FILE, str(tmp_path / "tier.key"))
    t = tmp_path / "tier"
    t.mkdir(mode=0o700)
    return t


def _save(tier: Path, step: int) -> tuple[Path, dict[str, Any]]:
    """A checkpoint of the example's model and AdamW whose floats are drawn from ``step``;
    also an int64 tensor and a string (taken from the base, never combined)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    model, opt, _ = fresh_state(example())
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
        for st in opt.state.values():
            st["exp_avg"].copy_(torch.randn(st["exp_avg"].shape, generator=gen))
            st["exp_avg_sq"].copy_(torch.rand(st["exp_avg_sq"].shape, generator=gen))
            st["step"].fill_(float(step))
    sd = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {"counter": torch.tensor([step, -step]), "note": f"step {step}"},
    }
    path = tier / checkpoint_name(step)
    path.mkdir(mode=0o700)
    md = dcp.save(sd, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    write_manifest(path, step, 1, extra={"dcp": metadata_to_json(md)})
    return path, load_whole(read_checkpoint(path))  # a deep copy, as saved


def _floats(sd: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every floating-point tensor of a nested state dict, by dotted path."""
    out: dict[str, torch.Tensor] = {}
    items = sd.items() if isinstance(sd, dict) else enumerate(sd) if isinstance(sd, list) else []
    for k, v in items:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            out[f"{prefix}{k}"] = v
        else:
            out.update(_floats(v, f"{prefix}{k}."))
    return out


def _combine(*args: str | Path) -> int:
    return ftmem_main(["combine", *(str(a) for a in args)])


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_unit_coefficients_reproduce_each_input_bitwise(tier: Path, tmp_path: Path) -> None:
    (p1, s1), (p2, s2) = _save(tier, 1), _save(tier, 2)
    for coeffs, base, want in (("1,0", p1, s1), ("0,1", p2, s2)):
        out = tmp_path / f"out-{coeffs}"
        assert _combine(p1, p2, "--coeffs", coeffs, "--base", base, "--out", out) == 0
        got = load_whole(read_checkpoint(out))
        _assert_same(_floats(got), _floats(want))
        assert torch.equal(got["extra"]["counter"], want["extra"]["counter"])
        assert got["extra"]["note"] == want["extra"]["note"]
        assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
        assert read_checkpoint(out).step == (1 if base == p1 else 2)


def test_half_and_half_is_the_mean_and_loads_with_stock_dcp_at_1_and_2_processes(
    tier: Path, tmp_path: Path
) -> None:
    (p1, s1), (p2, s2) = _save(tier, 1), _save(tier, 2)
    out = tmp_path / "mean"
    assert _combine(p1, p2, "--coeffs", "0.5,0.5", "--out", out) == 0
    got = load_whole(read_checkpoint(out))
    f1, f2 = _floats(s1), _floats(s2)
    mean = {k: ((f1[k].double() + f2[k].double()) / 2).to(f1[k].dtype) for k in f1}
    _assert_same(_floats(got), mean)
    assert got["extra"]["note"] == "step 2"  # non-float state from the newest (the base)
    assert torch.equal(got["extra"]["counter"], torch.tensor([2, -2]))

    ex = example()
    model, opt, _ = fresh_state(ex)
    model.load_state_dict(got["model"])
    # DCP's unflattening gives the optimizer's state string keys: back to parameter indices
    opt.load_state_dict(
        {**got["optim"], "state": {int(k): v for k, v in got["optim"]["state"].items()}}
    )
    digest = ex.state_digest(model, opt)
    assert load_digests(tmp_path, out, (1, 2)) == [[digest]] * 3


def test_ema_matches_a_reference_ema_over_the_steps_in_order(tier: Path, tmp_path: Path) -> None:
    saved = {step: _save(tier, step) for step in (1, 2, 3)}
    out = tmp_path / "ema"
    decay = 0.9
    paths = [saved[s][0] for s in (3, 1, 2)]  # any order: the EMA goes oldest step first
    assert _combine(*paths, "--ema", str(decay), "--out", out) == 0
    ema: dict[str, torch.Tensor] = {}
    for step in (1, 2, 3):
        for k, v in _floats(saved[step][1]).items():
            x = v.double()
            ema[k] = x if k not in ema else decay * ema[k] + (1 - decay) * x
    dtypes = {k: v.dtype for k, v in _floats(saved[1][1]).items()}
    _assert_same(
        _floats(load_whole(read_checkpoint(out))), {k: v.to(dtypes[k]) for k, v in ema.items()}
    )


def test_keys_limit_what_is_combined(tier: Path, tmp_path: Path) -> None:
    (p1, s1), (p2, s2) = _save(tier, 1), _save(tier, 2)
    out = tmp_path / "model-only"
    assert _combine(p1, p2, "--coeffs", "1,0", "--keys", "model", "--out", out) == 0
    got = _floats(load_whole(read_checkpoint(out)))
    f1, f2 = _floats(s1), _floats(s2)
    _assert_same(got, {k: (f1 if k.startswith("model.") else f2)[k] for k in f1})


def test_a_corrupted_input_is_refused_and_nothing_is_written(
    tier: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (p1, _), (p2, _) = _save(tier, 1), _save(tier, 2)
    data = next(p2.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    out = tmp_path / "bad"
    assert _combine(p1, p2, "--coeffs", "0.5,0.5", "--out", out) == 1
    assert "fails its checksum" in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.glob("bad.tmp-*")) == []


def test_mismatched_inputs_and_bad_arguments_are_clear_errors(
    tier: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (p1, _), (p2, _) = _save(tier, 1), _save(tier, 2)
    out = tmp_path / "out"
    assert _combine(p1, p2, "--coeffs", "1", "--out", out) == 1
    assert "1 coefficients for 2 checkpoints" in capsys.readouterr().err
    assert _combine(p1, p2, "--ema", "1.5", "--out", out) == 1
    assert "decay must be in [0, 1]" in capsys.readouterr().err
    out.mkdir()
    assert _combine(p1, p2, "--coeffs", "1,0", "--out", out) == 1
    assert "exists" in capsys.readouterr().err
    assert _combine(p1, p2, "--search", "no_such_module_here:f", "--out", tmp_path / "s") == 1
    assert "cannot load the evaluation" in capsys.readouterr().err


def test_search_finds_a_combination_that_beats_the_newest_checkpoint(
    tier: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = {step: _save(tier, step) for step in (1, 2, 3)}
    w = {s: saved[s][1]["model"]["tok_emb.weight"].double() for s in saved}
    evaldir = tmp_path / "eval"
    evaldir.mkdir()
    (evaldir / "ftmem_combine_eval.py").write_text(EVAL_MODULE)
    torch.save(0.3 * w[1] + 0.7 * w[3], evaldir / "ftmem_combine_eval.pt")
    monkeypatch.chdir(evaldir)  # a module there is never imported by name...
    with pytest.raises(CombineError, match="No module named 'ftmem_combine_eval'"):
        load_evaluator("ftmem_combine_eval:score")
    out = tmp_path / "best"
    paths = [saved[s][0] for s in (1, 2, 3)]
    spec = f"{evaldir / 'ftmem_combine_eval.py'}:score"  # ...only the file the user names
    code = _combine(*paths, "--search", spec, "--budget", "24", "--out", out)
    assert code == 0
    got = load_whole(read_checkpoint(out))["model"]["tok_emb.weight"].double()
    best = (got - (0.3 * w[1] + 0.7 * w[3])).abs().mean()
    newest = (w[3] - (0.3 * w[1] + 0.7 * w[3])).abs().mean()
    assert best < 0.5 * newest  # seeded, so the same every run
    combined = read_checkpoint(out)
    assert combined.step == 3


def test_checkpoints_of_a_real_run_combine_into_ones_ftmem_restores_each_rank_from(
    tier: Path, tmp_path: Path, smp: SmpProcess, run_dir: Path
) -> None:
    """Steps 19 and 20 of a 2-rank DDP run, written from the SMP in ftmem's flush format (per-
    rank RNG, skeletons and names as uint8 tensors, the step in ``ftmem_meta``): a unit
    combination with the same base is that step again, down to what ftmem's own disk restore
    gives each rank; the mean loads with stock dcp.load."""
    from ftmem.tiers.export import export_dcp, find_sources

    run = run_ranks(run_dir, SMALL, env_extra={"FTMEM_RUN_DIR": str(run_dir)})
    assert run.codes == [0, 0], run.outputs
    steps = {s: tier / checkpoint_name(s) for s in (19, 20)}
    sources = {s: find_sources([run_dir], step=s) for s in steps}
    for s, path in steps.items():
        export_dcp(sources[s], path)
    for s, coeffs in ((19, "1,0"), (20, "0,1")):
        out = tmp_path / f"unit-{s}"
        assert _combine(*steps.values(), "--coeffs", coeffs, "--base", steps[s], "--out", out) == 0
        combined = read_checkpoint(out)
        assert combined.step == s and combined.world_size == 2
        same_as_saved(combined, sources[s])
    mean = tmp_path / "mean"
    assert _combine(*steps.values(), "--coeffs", "0.5,0.5", "--out", mean) == 0
    got = load_whole(read_checkpoint(mean))
    a, b = (load_whole(read_checkpoint(p)) for p in steps.values())
    fa, fb, fg = _floats(a), _floats(b), _floats(got)
    assert fg.keys() == fa.keys() and len(fg) > 10
    for k in fa:
        assert torch.equal(fg[k], ((fa[k].double() + fb[k].double()) / 2).to(fa[k].dtype)), k
