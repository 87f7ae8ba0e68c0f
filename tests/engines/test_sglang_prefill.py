"""`engines.sglang_prefill` without SGLang: the DFLASH_ASYNC_PREFILL switch, and on a GPU that
the prompt lengths reach the device without a host sync where DFLASH's own copy syncs. That
`prefill` does DFLASH's prefill work is checked against SGLang 0.5.16's worker in
`sglang_env/checks_adaptive_prefill.py`."""

import pytest
import torch

from dflash_plugin.engines.sglang_prefill import enabled, lengths_on
from dflash_plugin.errors import ConfigError


def test_flag_values():
    """Unset or blank is on; 0 off; anything else a ConfigError naming the variable and the
    allowed values."""
    assert enabled({}) and enabled({"DFLASH_ASYNC_PREFILL": " "})
    assert enabled({"DFLASH_ASYNC_PREFILL": "1"}) and not enabled({"DFLASH_ASYNC_PREFILL": "0"})
    with pytest.raises(ConfigError, match="DFLASH_ASYNC_PREFILL.*0 or 1.*'yes'"):
        enabled({"DFLASH_ASYNC_PREFILL": "yes"})


def test_a_bad_flag_fails_the_launch(monkeypatch):
    """DFLASH_ADAPTIVE's launch-time validator reads the switch: a bad value is refused before
    any engine work (SGLang's server args stand-in: the validator reads their fields)."""
    from dflash_plugin.engines import sglang_adaptive

    monkeypatch.setenv("DFLASH_ASYNC_PREFILL", "2")
    monkeypatch.setattr(sglang_adaptive, "max_block", lambda sa: 16)
    monkeypatch.setattr(sglang_adaptive, "load_step_times", lambda path, w: {})
    with pytest.raises(ConfigError, match="DFLASH_ASYNC_PREFILL"):
        sglang_adaptive.validate_server_args(object())


def test_lengths_on_cpu():
    t = lengths_on([3, 0, 5], torch.device("cpu"))
    assert t.tolist() == [3, 0, 5] and t.dtype == torch.int32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_sync_on_a_gpu():
    """With the stream busy, `lengths_on` queues its copy without waiting (CUDA's sync debug
    mode raises on a synchronizing call); DFLASH's `torch.tensor(list, device=cuda)` does wait,
    so the check can tell the two apart. The values arrive, in stream order."""
    dev = torch.device("cuda")
    a = torch.randn(2048, 2048, device=dev)
    for _ in range(20):  # milliseconds of queued work
        a = a @ a / 2048 ** 0.5
    torch.cuda.set_sync_debug_mode("error")
    try:
        t = lengths_on([4, 3, 6], dev)
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.tensor([4, 3, 6], dtype=torch.int32, device=dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert t.tolist() == [4, 3, 6] and t.dtype == torch.int32
