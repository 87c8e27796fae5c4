"""Triton's CPU interpreter, scoped to one test module.

``TRITON_INTERPRET=1`` must be set before triton is first imported (the interpreter needs
triton's own library functions, and the kernels, decorated in interpreter mode), so a module
sets it at its top, parking the previous value in ``_TRITON_INTERPRET_BEFORE``, and after its
imports calls :func:`take_saved`. The whole suite shares one process: vLLM's kernels decorated
later, or a server subprocess, must not inherit the setting, so it is restored at once and set
again only while the module's tests run (:func:`scoped_env`)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


def take_saved() -> str | None:
    """The parked value (``"<unset>"``, or None where the module set nothing: a GPU), restored
    now."""
    saved = os.environ.pop("_TRITON_INTERPRET_BEFORE", None)
    restore(saved)
    return saved


def restore(saved: str | None) -> None:
    if saved is None:
        return
    if saved == "<unset>":
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = saved


def module_marks(interpreted: bool, has_cuda: bool) -> list:
    """Skip where neither the interpreter nor a GPU can run the kernels; silence the
    interpreter's own NumPy warning."""
    return [
        pytest.mark.skipif(
            not interpreted and not has_cuda,
            reason="no GPU, and triton was imported before this module could set "
            "TRITON_INTERPRET=1, so the CPU interpreter cannot run: run this file alone",
        ),
        # The interpreter's own loop-bound conversion warns under NumPy >= 1.25.
        pytest.mark.filterwarnings(
            "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
        ),
    ]


def scoped_env(interpreted: bool, saved: str | None) -> Iterator[None]:
    """A module fixture's body: interpreted launches read TRITON_INTERPRET too."""
    if not interpreted:
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        restore(saved)
