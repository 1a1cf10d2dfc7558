"""Every notebook in notebooks/ runs top to bottom in a fresh kernel and shows what it is meant to.

The notebooks are committed with their outputs; these tests execute them again (in this virtualenv's
Python) and fail on any cell error, on a "max |a - b| = ..." check printed above a tolerance, or when a
key output is missing.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

import nbclient
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from jupyter_client.manager import KernelManager

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 120
TOLERANCE = 1e-4

# Text each notebook must print (besides running without errors).
EXPECTED: dict[str, tuple[str, ...]] = {
    "01_quickstart": (
        "answered by: autotune",
        "time (ms)  config",
        "answered by: memory | same config: True",
        "configured kernel: True",
        "pending after save: 0",
        "answered by: persistent | same config: True",
        "inference runs chunked: True",
        "training runs dense: True",
    ),
    "02_custom_kernel": (
        "ValueError: ",
        "gives the same: True",
        "answered by: autotune | timed backward: True",
        "configured: SoftmaxCfg(block_rows=",
        "failed: [(2, 'check')]",
        "ejkfn.notebook_softmax.h",
    ),
    "03_offline_tuning": (
        "AutotuningResult(2 configs, 0 unmatched labels)",
        "every label carries the tuned config",
        "each layer carries its own call's tuned config: True",
    ),
    "04_multi_device": (
        "CpuDevice(id=3)",
        "batch axes: {'shard_map'",
        "tuned for flash_attention/",
        "same output: True",
        "max |ring - one device| = ",
        "max |ring dq, dk, dv - one device's| = ",
        "with the option, same output: True",
    ),
    "05_attention_features": (
        "max |packed - one call a document| = ",
        "same seed, same output: True",
        "another seed, another output: True",
        "gradient finite: True",
        "max |d capped - d by hand| = ",
        "window    -> xla/dense",
        "max |split in 4 - xla| = ",
        "max |causal draft, split in 4 - xla| = ",
    ),
}
# Rich outputs each notebook must show.
EXPECTED_MIME: dict[str, tuple[str, ...]] = {"01_quickstart": ("image/png",)}

_MAX_DIFF = re.compile(r"max \|[^|\n]*\|\s*=\s*([-+0-9.eEinfa]+)")


def _python_kernel(directory: pathlib.Path) -> KernelSpecManager | None:
    """``None`` when the "python3" kernel runs this Python; else a spec manager whose one does."""
    try:
        argv = KernelSpecManager().get_kernel_spec("python3").argv
    except NoSuchKernel:
        argv = []
    if argv:
        # jupyter_client launches a bare "python" as sys.executable.
        if argv[0] in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
            return None
        if os.path.exists(argv[0]) and os.path.samefile(argv[0], sys.executable):
            return None
    from ipykernel.kernelspec import install

    install(kernel_name="python3", prefix=str(directory))
    return KernelSpecManager(kernel_dirs=[str(directory / "share" / "jupyter" / "kernels")])


def _text(output: nbformat.NotebookNode) -> str:
    if output.output_type == "stream":
        return output.text
    data = output.get("data", {})
    return data.get("text/plain", "")


def test_notebooks_exist():
    assert {p.stem for p in NOTEBOOKS} >= set(EXPECTED), sorted(p.name for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: pathlib.Path, tmp_path: pathlib.Path):
    stored = nbformat.read(path, as_version=4)
    assert any(cell.get("outputs") for cell in stored.cells), (
        f"{path.name} is committed without outputs; execute it and save it with them"
    )

    nb = nbformat.read(path, as_version=4)
    specs = _python_kernel(tmp_path / "kernel")
    km = KernelManager(kernel_name="python3", **({"kernel_spec_manager": specs} if specs else {}))
    client = nbclient.NotebookClient(
        nb,
        km=km,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    # A cache directory of the test's own, in case a notebook falls back to the default one.
    client.execute(env={**os.environ, "EJKFN_CACHE_DIR": str(tmp_path / "cache")})

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(_text(o) for o in outputs)
    assert "Traceback" not in text, text
    for expected in EXPECTED.get(path.stem, ()):
        assert expected in text, f"{path.name}: {expected!r} not in its output:\n{text}"
    for mime in EXPECTED_MIME.get(path.stem, ()):
        assert any(mime in o.get("data", {}) for o in outputs), f"{path.name}: no {mime} output"
    diffs = [float(m) for m in _MAX_DIFF.findall(text)]
    assert all(d <= TOLERANCE for d in diffs), f"{path.name}: differences {diffs}"
