"""Integrations with training frameworks: ``ftmem.integrations.transformers`` (the Hugging Face
Trainer, ``pip install 'ftmem[hf]'``), ``ftmem.integrations.lightning`` (Lightning) and
``ftmem.integrations.torchtitan`` (torchtitan's checkpoint manager, ``pip install
'ftmem[torchtitan]'``). Each imports its framework only when imported itself."""

import importlib.metadata

from ftmem.errors import FtmemError


def require_version(package: str, minimum: tuple[int, int], user: str, extra: str) -> None:
    """Return if the installed ``package`` is at least ``minimum`` (major, minor).

    Raises:
        FtmemError: it is older; the message names ``user`` and ``pip install 'ftmem[extra]'``.
    """
    found = importlib.metadata.version(package)
    version = tuple(int(x) for x in found.split(".")[:2] if x.isdigit())
    if version < minimum:
        need = ".".join(map(str, minimum))
        raise FtmemError(
            f"{user} needs {package} >= {need} (found {found}); pip install 'ftmem[{extra}]'"
        )
