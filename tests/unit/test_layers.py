"""The package's layers import one way, the SMP never imports torch, and the package never
imports the checkout (tests, benchmarks, examples).

Layers, lowest first (docs/design.md, "Layout"): ``errors, config`` (and the small helpers
beside them) -> ``typed_json`` -> ``secure_fs`` -> ``format, protocol, shm, faults`` -> ``exchange, tiers`` (the libraries) ->
``client | smp | observe`` (what runs in a rank, in the SMP, in a reader of event logs) ->
``launch, cli``. A module may import its own package and any lower layer;
packages of one layer never import each other. Every import counts, also one inside a
function (that is how the client -> tiers -> client cycle hid); only ``if TYPE_CHECKING:``
blocks are exempt, since they never run.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "ftmem"

LAYERS: dict[str, float] = {
    "ftmem.errors": 0,
    "ftmem.config": 0,
    "ftmem._logging": 0,
    "ftmem._process": 0,
    "ftmem.events": 0,
    "ftmem.typed_json": 0.25,  # the one JSON reader, over errors
    "ftmem.secure_fs": 0.5,  # path checks over errors, under everything that opens files
    "ftmem.format": 1,
    "ftmem.protocol": 1,
    "ftmem.shm": 1,
    "ftmem.faults": 1,
    "ftmem.exchange": 2,
    "ftmem.tiers": 2,
    "ftmem.client": 3,
    "ftmem.smp": 3,
    "ftmem.observe": 3,
    "ftmem": 4,  # the package root: the public API over the client
    "ftmem.launch": 5,
    "ftmem.integrations": 5,  # framework integrations over the public API
    "ftmem.cli": 5,
}


_CHECKOUT = ("tests", "bench", "examples")
"""Top-level packages of the repository that are not the product."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    """The layer entry a module belongs to: ``ftmem.smp.daemon`` -> ``ftmem.smp``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT.parent / rel).with_suffix(".py").exists() or (ROOT.parent / rel).is_dir()


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(module: str, source: str, is_package: bool = False) -> list[tuple[int, str]]:
    """Every ftmem module that ``module`` (its ``source``) imports at run time, with the line."""
    tree = ast.parse(source, module)
    skip = _type_checking_lines(tree)
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("ftmem")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            if not base_name.startswith("ftmem"):
                continue
            for a in node.names:
                sub = f"{base_name}.{a.name}"
                out.append((node.lineno, sub if _is_module(sub) else base_name))
    return out


def violations(extra: dict[str, str] | None = None) -> list[str]:
    """Each import that runs against the layers, as ``module:line: a -> b``; ``extra`` adds
    modules (name -> source) to the package's own."""
    sources = {
        _module_name(p): (p.read_text(), p.name == "__init__.py") for p in ROOT.rglob("*.py")
    }
    sources.update({name: (text, False) for name, text in (extra or {}).items()})
    bad = []
    for module, (source, is_package) in sorted(sources.items()):
        src = _unit(module)
        assert src in LAYERS, f"{module}: add its package to LAYERS (and to docs/design.md)"
        for line, target in imports_of(module, source, is_package):
            dst = _unit(target)
            if dst == src:
                continue
            assert dst in LAYERS, f"{module}:{line}: unknown ftmem package {target}"
            if LAYERS[dst] >= LAYERS[src]:
                bad.append(f"{module}:{line}: {src} -> {target}")
    return bad


def test_imports_point_down_the_layers() -> None:
    assert violations() == []


def test_the_package_never_imports_the_checkout() -> None:
    # The test harness (tests/_support/) and the benchmarks stay out of the wheel: nothing in
    # the package may import them, even inside a function.
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad += [f"{path}:{node.lineno}: {n}" for n in names if n.split(".")[0] in _CHECKOUT]
    assert bad == []


def test_the_check_sees_imports_against_the_arrows() -> None:
    # The check itself must be able to fail: a tiers module importing the client inside a
    # function (the cycle this test was written for), a module of one layer importing its
    # sibling, and a relative import are reported; a TYPE_CHECKING import is not.
    probe = {
        "ftmem.tiers._probe": "def f() -> None:\n    from ftmem.client import flatten\n",
        "ftmem.client._probe": "from ..smp import store\n",
        "ftmem.smp._probe": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from ftmem.launch import agent\n",
    }
    assert violations(probe) == [
        "ftmem.client._probe:1: ftmem.client -> ftmem.smp.store",
        "ftmem.tiers._probe:2: ftmem.tiers -> ftmem.client.flatten",
    ]


def _loaded_by(modules: list[str], packages: tuple[str, ...]) -> list[str]:
    """The modules of ``packages`` (each a package or module name) that importing
    ``modules`` in a fresh interpreter loads."""
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        f"pkgs = {packages!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "    if any(m == p or m.startswith(p + '.') for p in pkgs))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return list(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.timeout(120)
def test_the_smp_never_imports_torch() -> None:
    # Every module of the SMP package, and the format and protocol layers it stands on.
    smp = sorted(_module_name(p) for p in (ROOT / "smp").rglob("*.py"))
    modules = [*smp, "ftmem.format", "ftmem.protocol", "ftmem.shm", "ftmem.faults"]
    assert _loaded_by(modules, ("torch",)) == []


@pytest.mark.timeout(120)
def test_the_agent_does_not_import_the_rank_side_client() -> None:
    # ftmem-launch starts once per node and at every replacement: the client (DTensor, DCP,
    # sympy through torch.distributed.tensor) would add about a second of CPU to each start.
    assert _loaded_by(["ftmem.launch.launch"], ("ftmem.client", "torch.distributed.tensor")) == []
