"""docs/configuration.md is generated from ppserve/config.py: the committed page equals a fresh run."""

from __future__ import annotations

import re

import pytest

from ppserve.tools.config_reference import COMMAND, CONFIG_PY, OUTPUT, _field_docs, render


def test_configuration_reference_is_fresh() -> None:
    assert OUTPUT.read_text() == render(), f"docs/configuration.md is stale: run `{COMMAND}`"


def test_every_field_is_documented_and_listed() -> None:
    import dataclasses

    from ppserve import config

    text = render()
    for section in dataclasses.fields(config.EngineConfig):
        assert f"## `{section.name}`" in text
        cls = type(getattr(config.EngineConfig(), section.name))
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f"{cls.__name__}.{f.name} is missing from the reference"


def test_a_field_without_a_comment_is_an_error() -> None:
    src = "class ServerConfig:\n    host: str = 'x'  # where\n    port: int = 1\n"
    assert _field_docs(src)["ServerConfig"] == {"host": "where", "port": ""}
    undocumented, n = re.subn(r"(?m)^(    port: int = \d+).*$", r"\1", CONFIG_PY.read_text())
    assert n == 1, "ServerConfig.port is not where this test looks for it"
    with pytest.raises(ValueError, match="ServerConfig.port"):
        render(config_src=undocumented)


def test_comments_above_and_beside_a_field_are_joined() -> None:
    src = ("class C:\n"
           "    # group note:\n"
           "    a: int = 1  # its own\n"
           "\n"
           "    # first line\n"
           "    # second line\n"
           "    b: int = 2\n"
           "    c: int = 3  # c | d\n")
    assert _field_docs(src)["C"] == {"a": "group note: its own", "b": "first line second line", "c": "c | d"}
