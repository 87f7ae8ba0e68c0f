"""Test helper for the checks of our HookRegistry hooks that are installed only when their
environment switch is on (`checks_decode_prep.py`, `checks_admission.py`)."""

import collections


def assert_installed_only_when_on(monkeypatch, module, hook, env: str, on: str) -> None:
    """`module.register_hook()` with `env` at 0 installs nothing (SGLang's method runs
    untouched); at `on` it installs `hook` on `module.TARGET` once, however often called."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(HookRegistry, "_hooks", collections.defaultdict(list))
    monkeypatch.setenv(env, "0")
    assert not module.register_hook() and module.TARGET not in HookRegistry._hooks
    monkeypatch.setenv(env, on)
    assert module.register_hook() and module.register_hook()
    assert [h for _, h, _ in HookRegistry._hooks[module.TARGET]] == [hook]
