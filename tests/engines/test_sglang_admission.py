"""`engines.sglang_admission` without SGLang: the DFLASH_BATCH_ADMISSION switch and the holding
rule (its refusal at launch: `test_sglang_launch_flags.py`). The hook against SGLang 0.5.16's
scheduler types is checked in `sglang_env/checks_admission.py`."""


import pytest

from dflash_plugin.engines.sglang_admission import hold, sglang_size, size_from_env
from dflash_plugin.errors import ConfigError


def test_flag_values():
    """Unset or blank is cost (the default); 0 (off); auto; integers >= 2; anything else (1,
    negative, words) a ConfigError naming the variable and the allowed values."""
    assert size_from_env({}) == "cost" and size_from_env({"DFLASH_BATCH_ADMISSION": " "}) == "cost"
    assert size_from_env({"DFLASH_BATCH_ADMISSION": "0"}) == 0
    assert size_from_env({"DFLASH_BATCH_ADMISSION": "AUTO"}) == "auto"
    assert size_from_env({"DFLASH_BATCH_ADMISSION": "4"}) == 4
    assert size_from_env({"DFLASH_BATCH_ADMISSION": "Cost"}) == "cost"
    for bad in ("1", "-2", "yes", "2.5"):
        with pytest.raises(ConfigError,
                           match="DFLASH_BATCH_ADMISSION.*auto, cost or an integer >= 2"):
            size_from_env({"DFLASH_BATCH_ADMISSION": bad})


def test_sglang_size_is_its_formula():
    """min(4, max(2, (max_running + 5) // 6)): 2 up to 12 slots, 3 at 13-18, 4 from 19."""
    assert [sglang_size(n) for n in (0, 8, 12, 13, 18, 19, 64, 1024)] == [2, 2, 2, 3, 3, 4, 4, 4]


def test_hold_rule():
    """Held while a batch decodes, fewer than min(k, free) wait and fewer than k passes were
    held; never during a chunked prefill, with nothing running, nothing waiting, or off."""
    base = dict(k=4, running=32, waiting=1, free=32, held=0, chunked=False)
    assert hold(**base)
    assert hold(**dict(base, waiting=3, held=3))
    for change in (dict(waiting=4), dict(held=4), dict(running=0), dict(waiting=0),
                   dict(chunked=True), dict(k=0), dict(free=1), dict(free=2, waiting=2)):
        assert not hold(**dict(base, **change)), change
    assert hold(**dict(base, free=3, waiting=2))  # 3 can be admitted, 2 wait


def test_a_closed_loop_admits_k_at_a_time():
    """A scheduler loop of the rule: one request finishes per decode step at 32 of 64 slots;
    admissions come 4 at a time and no request waits more than 4 passes."""
    k, running, waiting, held, sizes, waits, queue = 4, 32, 0, 0, [], [], []
    for step in range(200):
        running -= 1  # a request finishes, its replacement arrives
        waiting += 1
        queue.append(step)
        if hold(k=k, running=running, waiting=waiting, free=64 - running, held=held,
                chunked=False):
            held += 1
        else:
            sizes.append(waiting)
            waits += [step - t for t in queue]
            running, waiting, held, queue = running + waiting, 0, 0, []
    assert set(sizes) == {4} and max(waits) <= 4
