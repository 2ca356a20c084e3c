"""Make SGLang 0.5.23 importable on a CPU-only machine, for tests only.

The plugin itself never needs this: inside a real engine SGLang brings its
own Triton and CUDA. On a CPU-only dev or CI machine ``make test`` installs
``sglang==0.5.23 --no-deps`` plus the small set in the ``sglang`` extra, and
three gaps remain, each closed here before the first ``import sglang``:

* ``triton`` (imported unconditionally by ``sglang.srt.utils.common``): the
  real wheel is ~1 GB, so SGLang's own Triton stand-in from
  ``sglang/_platform_stubs.py`` (which SGLang installs by itself only on
  Apple MPS) is loaded standalone and only its Triton part is replayed.
* ``torchvision`` (pulled in by a multimodal config module): installing it
  swaps torch for a CUDA build, so transformers is told it is absent and
  SGLang's module mock stands in.
* ``datasets`` (imported by SGLang's test kit through its benchmark code):
  mocked the same way; nothing here loads a data set.
* pinned host memory (``cudaHostRegister``): host pools are built pageable.

``install()`` is idempotent and returns False (with the reason in
``SKIP_REASON``) when SGLang is not installed, so tests can skip cleanly.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import textwrap

SGLANG_VERSION = "0.5.23"
SKIP_REASON = ""
_done = False


def _install_triton_stub(stubs_path: str) -> type:
    spec = importlib.util.spec_from_file_location("_gcache_sglang_platform_stubs", stubs_path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)  # defines helpers only; installs nothing by itself
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return mod._MockModule
    src = textwrap.dedent(inspect.getsource(mod.install_platform_stubs))
    start = src.index('    if "triton" not in sys.modules')
    end = src.index("    mps = torch.mps")
    block = textwrap.dedent(src[start:end])
    exec(compile(block, stubs_path, "exec"), vars(mod))  # noqa: S102 - SGLang's own stub code
    return mod._MockModule


class _MockFinder:
    """Meta-path finder: every ``torchvision[.x]`` import yields a permissive mock module."""

    def __init__(self, mock_cls: type, prefix: str) -> None:
        self.mock_cls, self.prefix = mock_cls, prefix

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001
        if fullname != self.prefix and not fullname.startswith(self.prefix + "."):
            return None
        if fullname not in sys.modules:
            mod = self.mock_cls(fullname)
            sys.modules[fullname] = mod
            parent, _, child = fullname.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, mod)
        return sys.modules[fullname].__spec__


def _mock_torchvision(mock_cls: type) -> None:
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    try:  # let transformers cache "no torchvision" before the mock exists
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
        import_utils.is_torchvision_v2_available()
    except Exception:
        pass
    sys.meta_path.insert(0, _MockFinder(mock_cls, "torchvision"))


def _mock_if_absent(mock_cls: type, name: str) -> None:
    if name not in sys.modules and importlib.util.find_spec(name) is None:
        sys.meta_path.insert(0, _MockFinder(mock_cls, name))


def install() -> bool:
    """Prepare the interpreter to import SGLang on CPU. Returns False if SGLang is absent."""
    global _done, SKIP_REASON
    if _done:
        return True
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        SKIP_REASON = ("sglang is not installed; `make test` installs it "
                       f"(sglang=={SGLANG_VERSION} --no-deps plus the `sglang` extra)")
        return False
    pkg_dir = list(spec.submodule_search_locations)[0]
    os.environ.setdefault("SGLANG_DISABLE_REQUEST_LOGGING", "1")
    mock_cls = _install_triton_stub(os.path.join(pkg_dir, "_platform_stubs.py"))
    _mock_torchvision(mock_cls)
    _mock_if_absent(mock_cls, "datasets")  # SGLang's test kit imports its benchmark datasets
    _done = True
    return True


def finish() -> None:
    """Patches that need SGLang modules imported: pageable host pools."""
    from sglang.srt.mem_cache.pool_host import common as pool_common

    pool_common._cuda_host_register = lambda *a, **k: None
    pool_common._cuda_host_unregister = lambda *a, **k: None


__all__ = ["install", "finish", "SKIP_REASON", "SGLANG_VERSION"]
