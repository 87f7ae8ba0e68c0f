"""Batched admission for DFLASH_ADAPTIVE and DFLASH_TREE below full load (SGLang 0.5.16).

Each admission into a DFLASH-family server is a prefill pass of its own: the target's prefill,
the prompt's drafter-KV writes, the result processing, the merge into the running batch. SGLang
knows it is costly: for DFLASH it holds new prefills until `min(4, max(2, (max_running + 5) //
6))` running slots are free (`min_free_slots_delayer.py`, "useful when each admission is
disproportionately expensive, e.g. speculative decoding with a separate draft prefill pass").
That rule only acts at full load. Below it every finished request is replaced by a prefill
pass of one request, and with speculation a request finishes every few steps: on the fixture at
32 of 64 slots (H100, 2026-12-06) about one prefill pass per decode step, where DFLASH's server
and ours ran at 0.79-0.89x plain SGLang, while at 64 of 64 (admissions batched by SGLang's rule)
they ran at 0.99-1.09x.

`DFLASH_BATCH_ADMISSION=K` (K >= 2; `auto`: SGLang's number above; `cost`, the default:
DFLASH_ADAPTIVE's K at each pass from its launch ledger, the measured step and pass costs and
arrival rate, by `admission.hold_size`: 1, no hold, at light loads) holds a scheduler pass's
new prefill while the running batch decodes, fewer than min(K, free slots) requests wait, and
fewer than K passes have been held since the last admission; so a request waits at most K
decode steps, and admissions come about K at a time. 0: SGLang's scheduling. Outputs do not
depend on it (requests are decoded alone; only when they start changes). Installed as a
HookRegistry AROUND hook on `Scheduler.get_new_batch_prefill` unless 0; it acts on our
algorithms' servers only (`cost` on DFLASH_ADAPTIVE's, the one with a ledger), SGLang's pass
runs untouched on every other server. Why `cost` is the default (H100, fixture, limit 64, 16
waves, 2026-12-07, BENCHMARKS.md "Admission by cost"): at 32 requests the adaptive server
made 22,420-22,571 tok/s with 0, 28,576-28,732 with `auto` and 26,773-28,230 with `cost`; the
goal's table with `cost` met max(plain, DFLASH) at 1-64 requests in two starts (1.05-1.29x),
while `auto` held light loads too and lost at 4-16 requests in 2-wave loops (2026-12-06).
"""

from __future__ import annotations

import os

from ..admission import hold_size_from_ledger
from ..errors import ConfigError

ENV = "DFLASH_BATCH_ADMISSION"
TARGET = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
OURS = ("DFLASH_ADAPTIVE", "DFLASH_TREE")
HELD = "_dflash_admission_held"  # the scheduler's passes held since its last admission
_SETTLED: dict = {}


def size_from_env(environ=os.environ) -> int | str:
    """`DFLASH_BATCH_ADMISSION`: 'cost' (default, also when blank), 'auto', 0 (off) or an
    integer K >= 2; a `ConfigError` otherwise."""
    raw = environ.get(ENV, "").strip().lower() or "cost"
    if raw in ("auto", "cost"):
        return raw
    try:
        k = int(raw)
    except ValueError:
        k = -1
    if k != 0 and k < 2:
        raise ConfigError(ENV, f"must be 0 (off), auto, cost or an integer >= 2 (requests "
                               f"admitted together), got {raw!r}")
    return k


def sglang_size(max_running: int) -> int:
    """SGLang 0.5.16's DFLASH admission size for `max_running` slots (its formula)."""
    return min(4, max(2, (max(0, int(max_running)) + 5) // 6))


def hold(*, k: int, running: int, waiting: int, free: int, held: int, chunked: bool) -> bool:
    """Hold this pass's prefill? Only while a batch decodes meanwhile, no chunked prefill is
    under way, fewer than min(k, free) requests wait (more cannot be admitted anyway) and
    fewer than k passes have been held."""
    return (k >= 2 and not chunked and running > 0 and 0 < waiting < min(k, free)
            and held < k)


def around_get_new_batch_prefill(original, scheduler, running_batch):
    """The AROUND hook: `hold` on our algorithms' schedulers, SGLang's pass otherwise."""
    if getattr(scheduler.spec_algorithm, "name", None) not in OURS:
        return original(scheduler, running_batch)
    decoding = running_batch is not None and not getattr(running_batch, "is_prefill_only", False)
    running = running_batch.batch_size() if decoding else 0  # only a decoding batch goes on
    waiting, k = len(scheduler.waiting_queue), _SETTLED["size"]
    if k == "auto":
        k = sglang_size(scheduler.max_running_requests)
    elif k == "cost":  # DFLASH_ADAPTIVE's ledger; a worker without one is not held
        ledger = getattr(getattr(scheduler, "draft_worker", None), "ledger", None)
        k = hold_size_from_ledger(ledger, running + waiting) if ledger and waiting else 0
    held = getattr(scheduler, HELD, 0)
    if hold(k=k, running=running, waiting=waiting,
            free=scheduler.get_num_allocatable_reqs(running), held=held,
            chunked=scheduler.chunked_req is not None):
        from sglang.srt.managers.schedule_batch import NextBatchPlan

        setattr(scheduler, HELD, held + 1)
        return NextBatchPlan(batch_to_run=None, running_batch=running_batch)
    plan = original(scheduler, running_batch)
    if plan.batch_to_run is not None:
        setattr(scheduler, HELD, 0)
    return plan


def register_hook() -> bool:
    """Install the AROUND hook once unless `DFLASH_BATCH_ADMISSION` is 0 (HookRegistry applies
    it in `load_plugins`); True when it is installed."""
    _SETTLED["size"] = size_from_env()
    if _SETTLED["size"] == 0:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not any(h is around_get_new_batch_prefill
               for _, h, _ in HookRegistry._hooks.get(TARGET, [])):
        HookRegistry.register(TARGET, around_get_new_batch_prefill, HookType.AROUND)
    return True
