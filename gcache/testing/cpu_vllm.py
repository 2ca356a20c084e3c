"""Make vLLM 0.33.0's scheduler importable on this CPU-only machine, for tests only.

``make test`` installs ``vllm==0.33.0 --no-deps`` plus the ``vllm`` extra. One gap
remains: vLLM imports ``openai.types.responses.NamespaceTool`` (openai >= 2.25), while
the SGLang tests pin ``openai==2.8.0``. ``install()`` gives that one name (an empty class:
nothing here builds tool-call schemas), also in the subprocess vLLM runs to inspect a
model class. It returns False, with the reason in ``SKIP_REASON``, when vLLM is absent.
"""

from __future__ import annotations

import importlib.util
import sys

VLLM_VERSION = "0.33.0"
SKIP_REASON = ""
PATCH = ("import openai.types.responses as _r\n"
         "_r.NamespaceTool = getattr(_r, 'NamespaceTool', None) or type('NamespaceTool', (), {})\n")
_done = False


def install() -> bool:
    global SKIP_REASON, _done
    if _done:
        return not SKIP_REASON
    _done = True
    if importlib.util.find_spec("vllm") is None:
        SKIP_REASON = (f"vLLM is not installed: make test installs it (pip install --no-deps "
                       f"vllm=={VLLM_VERSION} and the gcache[vllm] extra)")
        return False
    exec(PATCH, {})  # noqa: S102 - the one alias above
    import vllm.model_executor.models.registry as registry

    registry._SUBPROCESS_COMMAND = [
        sys.executable, "-c",
        PATCH + "import runpy\nrunpy.run_module('vllm.model_executor.models.registry', "
                "run_name='__main__')\n"]
    return True
