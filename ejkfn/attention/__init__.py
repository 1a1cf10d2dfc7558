"""Flash attention: one semantics (``_spec.py``), one reference, a backend module per platform.

Importing this package registers every backend module that exists here. A backend whose optional GPU
dependency cannot be imported on this machine (e.g. ``jax_triton`` without a CUDA plugin) is left out
and the reason kept in :data:`UNAVAILABLE`; any other import error (a bug) is raised.
"""

import importlib
import importlib.util
import types

from . import _cudnn as _cudnn
from . import _xla as _xla

# Dependencies that may be missing or refuse to import on machines without a GPU.
_OPTIONAL_DEPENDENCIES = ("triton", "jax_triton", "torch")
_BACKEND_MODULES = ("_pallas_gpu", "_pallas_mosaic", "_pallas_tpu", "_triton")

# module name -> why it was left out; filled once, at import.
UNAVAILABLE: dict[str, str] = {}


def _from_optional_dependency(exc: ImportError) -> bool:
    """Whether ``exc`` comes from an optional dependency, not from ejkfn's own code."""
    name = (exc.name or "").split(".")[0]
    if name in _OPTIONAL_DEPENDENCIES:
        return True
    tb: types.TracebackType | None = exc.__traceback__
    while tb is not None:
        if tb.tb_next is None:  # the frame that raised
            module = str(tb.tb_frame.f_globals.get("__name__", ""))
            return module.split(".")[0] in _OPTIONAL_DEPENDENCIES
        tb = tb.tb_next
    return False


for _name in _BACKEND_MODULES:
    if importlib.util.find_spec(f"{__name__}.{_name}") is None:
        continue
    try:
        importlib.import_module(f"{__name__}.{_name}")
    except ImportError as _exc:
        if not _from_optional_dependency(_exc):
            raise
        UNAVAILABLE[_name] = f"{type(_exc).__name__}: {_exc}"

from ._api import AttentionConfig as AttentionConfig  # noqa: E402
from ._api import FlashAttention as FlashAttention  # noqa: E402
from ._api import flash_attention as flash_attention  # noqa: E402
from ._api import registered_backends as registered_backends  # noqa: E402
from ._backend import AttentionBackend as AttentionBackend  # noqa: E402
from ._backend import AttentionShape as AttentionShape  # noqa: E402
from ._ring import ring_attention as ring_attention  # noqa: E402
from ._ring import ring_attention_sharded as ring_attention_sharded  # noqa: E402
from ._ring import zigzag_order as zigzag_order  # noqa: E402
from ._spec import AttentionSpec as AttentionSpec  # noqa: E402
