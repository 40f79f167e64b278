"""A flash-attn wheel that is installed but does not import (built for another torch or CUDA) must not
take the workers down: `auto` falls back to the next backend with one warning, and asking for flash-attn
by name is an error that carries the import's own message."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from ppserve.model import attention, backend_select, triton_attention
from ppserve.model.attention import SdpaBackend


@pytest.fixture
def broken_flash_attn(tmp_path, monkeypatch):
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(attention, "_FLASH_IMPORT", [])  # this process has not tried it yet
    monkeypatch.setattr(backend_select, "_warned", set())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine


def test_auto_falls_back_from_a_broken_flash_attn_with_one_warning(broken_flash_attn, caplog, monkeypatch):
    monkeypatch.setattr(triton_attention, "triton_available", lambda: False)  # its backend needs a real GPU
    with caplog.at_level(logging.WARNING, logger="ppserve.model.backend_select"):
        first = backend_select.select_backend("cuda", "auto")
        second = backend_select.select_backend("cuda", "auto")
    assert isinstance(first, SdpaBackend) and isinstance(second, SdpaBackend)  # the next one with no Triton
    warnings = [r.getMessage()
                for r in caplog.records if "flash-attn is installed but does not import" in r.getMessage()]
    assert len(warnings) == 1 and "undefined symbol" in warnings[0]


def test_asking_for_a_broken_flash_attn_names_the_import_error(broken_flash_attn):
    with pytest.raises(ValueError,
                       match="does not import: ImportError: flash_attn_2_cuda.so: undefined symbol"):
        backend_select.select_backend("cuda", "flash_attn")


def test_without_flash_attn_auto_picks_what_it_picked_before(monkeypatch):
    monkeypatch.setattr(attention, "_FLASH_IMPORT", [])
    assert not attention.flash_attn_available()  # no CUDA here, and no flash-attn
