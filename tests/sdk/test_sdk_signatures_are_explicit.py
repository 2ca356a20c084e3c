"""The SDK's public surface is typed and documented: no ``**kwargs`` catch-all, a
return annotation and a docstring on every public method of ``Client``, and the
package ships ``py.typed``."""

from __future__ import annotations

import importlib.resources
import inspect

import pytest

from gcache.sdk import Client

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

PUBLIC = [(n, f) for n, f in inspect.getmembers(Client, inspect.isfunction)
          if not n.startswith("_")]


def test_public_methods_take_explicit_keywords_and_say_what_they_return() -> None:
    assert len(PUBLIC) > 25
    for name, fn in PUBLIC:
        sig = inspect.signature(fn)
        assert all(p.kind is not p.VAR_KEYWORD for p in sig.parameters.values()), name
        assert sig.return_annotation is not inspect.Signature.empty, name
        assert (fn.__doc__ or "").strip(), f"Client.{name} has no docstring"


def test_an_unknown_keyword_is_a_type_error_at_the_call() -> None:
    for name in ("get", "get_batch", "put", "put_batch", "exists", "delete", "touch",
                 "get_batch_into", "put_batch_from"):
        sig = inspect.signature(getattr(Client, name))
        sig.bind_partial(timeout_ms=5)  # the real keyword binds
        with pytest.raises(TypeError, match="timeoutms"):
            sig.bind_partial(timeoutms=5)  # a typo does not vanish into **kwargs


def test_the_package_ships_its_type_marker() -> None:
    assert importlib.resources.files("gcache").joinpath("py.typed").is_file()
