"""The greedy rows of `gpu_dllm.py run` on SGLang's CPU server (fp32), for a reference.

Same model (the `gpu_dllm.py prepare` work dir: SDAR conversion + algorithm YAMLs), prompts
(the first --num-prompts dev prompts, left-truncated to --max-prompt-tokens), new tokens, EOS
ignored, closed loop of each --concurrency; but SGLang's `--device cpu`, torch-native attention,
fp32 (the SGLang test env of `make setup` in .venv/sglang). Output: a JSON in `gpu_dllm.py`'s
layout (rows[].token_ids, prompt_tokens), so `greedy_margins.py` and `first_diff` comparisons
read GPU and CPU runs alike. On 2026-12-02 it separated a GPU-only deviation of Spiffy at 8
requests (BENCHMARKS.md, "Spiffy inside SGLang 0.5.16 on the GPU") from the algorithm: here
every token of the same 8-request row follows one-step decoding exactly.

    python benchmarks/gpu_dllm.py prepare --work /tmp/dw
    python benchmarks/sglang_dllm_rows_cpu.py --work /tmp/dw --algorithm Spiffy --concurrency 8 \
        --out benchmarks/results/gpu-dllm/cpu-spiffy.json          # about 3 min on 2 CPUs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import DEV_PROMPTS, fixture
from gpu_dllm import CONFIGS, prompt_ids
from sglang_spiffy_nfe import server_env

from dflash_plugin.engines.vllm_server import VLLMServer, free_port, request


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, help="a `gpu_dllm.py prepare` directory")
    p.add_argument("--algorithm", choices=sorted(CONFIGS), required=True)
    p.add_argument("--model", default=str(fixture("code-dllm")), help="tokenizer")
    p.add_argument("--prompts", default=str(DEV_PROMPTS))
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8])
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    work = Path(a.work).resolve()
    ids = prompt_ids(a)  # gpu_dllm's: the same prompts, the same truncation
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(work / "sdar"),
           "--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
           "--dllm-algorithm", a.algorithm, "--dllm-algorithm-config",
           str(work / CONFIGS[a.algorithm]), "--host", "127.0.0.1", "--port", str(free_port()),
           "--max-total-tokens", "16384", "--max-running-requests", "80",
           "--skip-server-warmup"]
    doc = {"kind": "dllm-run", "engine": "sglang", "device": "cpu", "dtype": "float32",
           "algorithm": a.algorithm, "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "num_prompts": len(ids), "max_tokens": a.max_tokens,
           "prompt_tokens": [len(x) for x in ids], "rows": []}
    sp = {"max_new_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True}
    with VLLMServer(cmd, env=server_env(), log_path=out.with_suffix(".log")) as srv:
        def one(x):
            status, body = request(f"{srv.url}/generate", {"input_ids": x, "sampling_params": sp})
            if status != 200:
                raise RuntimeError(f"status {status}: {body}")
            return body["output_ids"]

        for c in a.concurrency:
            t = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                outs = list(pool.map(one, ids))
            doc["rows"].append({"concurrency": c, "wall_s": time.perf_counter() - t,
                                "token_ids": outs})
            out.write_text(json.dumps(doc, indent=1))
            print(f"{a.algorithm} CPU c={c}: {doc['rows'][-1]['wall_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
