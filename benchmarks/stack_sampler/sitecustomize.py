"""An opt-in wall-clock stack sampler for every Python process that starts with this folder on
PYTHONPATH (SGLang's scheduler subprocesses too: `spawn` starts a fresh interpreter, which
imports `sitecustomize`). A benchmark tool, not part of any package.

With STACK_SAMPLE_DIR set, a daemon thread samples every other thread's Python stack every
STACK_SAMPLE_MS (default 1) while the file DIR/label holds a label, and rewrites
DIR/<pid>.txt every 2 s and whenever the label changes: one line per (label, thread, stack),
`microseconds<TAB>label<TAB>thread<TAB>frame;frame;...` (outermost first, frames as
`dir/file.py:qualname`). A thread that holds the GIL would delay the sampler by up to the 5 ms
switch interval, which favours frames that release it; so the switch interval drops to 0.1 ms
in a sampled process (a switch happens only when another thread waits for the GIL) and each
sample weighs the wall time since the previous one. A thread blocked in C (a CUDA sync, a
socket) is charged at the Python frame that called it.
Read with `python benchmarks/stack_report.py DIR`.
"""

import os

_DIR = os.environ.get("STACK_SAMPLE_DIR")


def _frame_name(code) -> str:
    parts = code.co_filename.replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{getattr(code, 'co_qualname', code.co_name)}"


def _write(path: str, counts) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for (label, thread, stack), n in counts.items():
            f.write(f"{n}\t{label}\t{thread}\t{stack}\n")
    os.replace(tmp, path)


def _sample_forever(directory: str) -> None:
    import collections
    import sys
    import threading
    import time

    every = float(os.environ.get("STACK_SAMPLE_MS", "1")) / 1e3
    out = os.path.join(directory, f"{os.getpid()}.txt")
    me = threading.get_ident()
    counts: collections.Counter = collections.Counter()
    label, names, next_label, next_dump = None, {}, 0.0, 0.0
    last = time.monotonic()
    while True:
        now = time.monotonic()
        weight, last = int(1e6 * (now - last)), now
        if now >= next_label:
            was = label
            try:
                with open(os.path.join(directory, "label")) as f:
                    label = f.read().strip() or None
            except OSError:
                label = None
            if label != was:
                next_dump = now  # a finished label is on disk before a shutdown can stop us
            names = {t.ident: t.name for t in threading.enumerate()}
            next_label = now + 0.05
        if label:
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                stack = []
                while frame is not None:
                    stack.append(_frame_name(frame.f_code))
                    frame = frame.f_back
                counts[(label, names.get(tid, str(tid)), ";".join(reversed(stack)))] += weight
        if now >= next_dump:
            if counts:
                _write(out, counts)
            next_dump = now + 2.0
        time.sleep(every)


if _DIR:
    import sys as _sys
    import threading as _threading

    _sys.setswitchinterval(1e-4)
    os.makedirs(_DIR, exist_ok=True)
    _threading.Thread(target=_sample_forever, args=(_DIR,), name="stack-sampler",
                      daemon=True).start()
