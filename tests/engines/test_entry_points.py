"""The engine entry points of this distribution: one per package, owned by it and named after its
import name (the names `SGLANG_PLUGINS` / `VLLM_PLUGINS` whitelist), and a vLLM registration
that fails is logged, never raised (vLLM calls general plugins unguarded). SGLang's own loader
(which isolates and logs each entry point) is exercised in tests/engines/sglang_env/checks.py."""

import logging
import sys
from importlib import metadata

EXPECTED = {
    "vllm.general_plugins": {"dflash_plugin": "dflash_plugin.engines.vllm:register"},
    "sglang.srt.plugins": {"dflash_plugin": "dflash_plugin.engines.sglang:register",
                           "spiffy_plugin": "spiffy_plugin.engines.sglang:register",
                           "specfold_plugin": "specfold_plugin.engines.sglang:register"},
}


def test_each_package_owns_its_entry_points():
    dist = metadata.distribution("specdec-plugins")
    for group, expected in EXPECTED.items():
        ours = {ep.name: ep.value for ep in dist.entry_points if ep.group == group}
        assert ours == expected, f"{group}: {ours} (stale metadata? reinstall: make setup)"
        for name, value in ours.items():
            assert value.split(".")[0] == name  # the entry point lives in the package it names


def test_vllm_registration_failure_is_logged_not_raised(monkeypatch, caplog):
    from dflash_plugin.engines import vllm as adapter

    monkeypatch.setitem(sys.modules, "vllm", None)  # `from vllm import ...` raises ImportError
    with caplog.at_level(logging.ERROR, logger=adapter.__name__):
        adapter.register()
    (record,) = caplog.records
    assert "DFlashDraftModel not registered" in record.getMessage() and record.exc_info
