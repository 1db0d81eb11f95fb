"""flashkda.register_as_flash_kda(): ``import flash_kda`` resolves to flashkda in this process.

Engines built on fla reach a FlashKDA-compatible kernel through ``import flash_kda`` and
``flash_kda.fwd(...)``. Registering puts a module named ``flash_kda`` into ``sys.modules`` that
exposes flashkda's calls, so that code runs unchanged on flashkda. Opt-in and per process; it
never replaces a different ``flash_kda`` that is already imported.
"""

from __future__ import annotations

import importlib.machinery
import sys
import threading
import types

_NAME = "flash_kda"
_MARKER = "__flashkda_alias__"  # set on the module registered here, to tell it from a real flash_kda
_lock = threading.Lock()


def _make_module() -> types.ModuleType:
    import flashkda

    module = types.ModuleType(
        _NAME,
        "flash_kda served by flashkda (flashkda.register_as_flash_kda()): fwd is flashkda.fwd, "
        "forward flashkda.forward, info flashkda.info.",
    )
    module.fwd = flashkda.fwd
    module.forward = flashkda.forward
    module.info = flashkda.info
    module.WITH_CUDA = flashkda.WITH_CUDA
    module.__version__ = flashkda.__version__
    module.__all__ = ["fwd", "forward", "info", "WITH_CUDA"]
    # A spec, so that importlib.util.find_spec("flash_kda") (how fla and others probe for the
    # package) finds it instead of raising on a module without one.
    module.__spec__ = importlib.machinery.ModuleSpec(_NAME, None, origin="flashkda")
    module.__loader__ = None
    module.__package__ = ""
    setattr(module, _MARKER, True)
    return module


def register_as_flash_kda() -> types.ModuleType:
    """Makes ``import flash_kda`` resolve to flashkda in this process; returns that module.

    The module exposes ``fwd`` (:func:`flashkda.fwd`, the call and argument order of
    ``flash_kda.fwd``), ``forward``, ``info``, ``WITH_CUDA`` and ``__version__``. Only the Python
    module is aliased: other names of a real ``flash_kda`` installation (its ``flash_kda_C``
    extension, ``torch.ops.flash_kda``) are not provided. Call it before the code that imports
    ``flash_kda`` runs (fla probes for it once, at its first use). Calling it again returns the
    same module.

    Raises:
        RuntimeError: a different ``flash_kda`` module (a real installation) is already imported
            in this process; it is left in place, since code may already hold it.
    """
    with _lock:
        existing = sys.modules.get(_NAME)
        if existing is not None:
            if getattr(existing, "__dict__", {}).get(_MARKER) is True:
                return existing
            where = getattr(existing, "__file__", None) or getattr(existing, "__spec__", None) or existing
            raise RuntimeError(
                f"flashkda.register_as_flash_kda(): a different flash_kda module is already imported in this "
                f"process ({where}); flashkda does not replace it. Register before anything imports flash_kda, "
                f"or keep using that flash_kda"
            )
        module = _make_module()
        sys.modules[_NAME] = module
        return module
