"""Model forwards of Spiffy inside SGLang's own server, next to one-step decoding and our runtime.

    python benchmarks/sglang_spiffy_nfe.py --model examples/fixtures/code-dllm \
        --prompts examples/fixtures/dev-prompts.jsonl --calib 32:40 --eval 0:4 \
        --budget 8 --max-new-tokens 96 --out benchmarks/results/sglang-spiffy-nfe.json
CPU only (SGLang's `--device cpu`, torch-native attention, fp32; needs the SGLang test env of
`make setup` in .venv/sglang). Calibrates a graph on `--calib` (vanilla rule, 1 token / step),
converts the model to SDAR, serves it with `--dllm-algorithm Spiffy`, and sends each `--eval`
prompt alone. *SGLang forwards* = the sum of the algorithm's per-block counts (SGLang's own
per-forward log lines are checked to agree); *one-step forwards* = steps + 1 per block, what
SGLang spends decoding the same trajectory one step per forward; *reference* = our runtime's NFE
for vanilla and Spiffy (it commits a block inside the next block's first forward). Tokens must
equal the reference's (checked).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench.common import DEV_PROMPTS, fixture, read_prompts, span, write_json
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_plugin.engines.vllm_server import VLLMServer, free_port, request
from spiffy_plugin.calibrate import calibrate
from spiffy_plugin.decode import DecodeParams, generate
from spiffy_plugin.engines.sdar import convert_to_sdar
from spiffy_plugin.spiffy import spiffy_generate

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"Spiffy block: rid=(\S+) forwards=(\d+) steps=(\d+) accepted=(\d+)")


def server_env() -> dict[str, str]:
    path = [str(ROOT), str(ROOT / ".venv" / "sglang"), str(ROOT / "tests/engines/sglang_env/site")]
    path += [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path),
                SGLANG_PLUGINS="spiffy_plugin,specfold_plugin",
                OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(fixture("code-dllm")))
    p.add_argument("--prompts", default=str(DEV_PROMPTS))
    p.add_argument("--calib", default="32:40")
    p.add_argument("--calib-tokens", type=int, default=64)
    p.add_argument("--eval", default="0:4")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--keep", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    prompts = read_prompts(a.prompts)
    params = DecodeParams(unmask_per_step=1)
    graph = calibrate(model, [tok(x).input_ids for x in prompts[span(a.calib)]], a.budget,
                      params, max_new_tokens=a.calib_tokens)
    tmp = Path(tempfile.mkdtemp(prefix="sglang-spiffy-"))
    graph.save(tmp / "graph.json")
    keep = f"keep: {a.keep}\n" if a.keep else ""
    (tmp / "spiffy.yaml").write_text(f"graph: {tmp / 'graph.json'}\n{keep}")
    sdar = convert_to_sdar(a.model, tmp / "sdar")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(sdar),
           "--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
           "--dllm-algorithm", "Spiffy", "--dllm-algorithm-config", str(tmp / "spiffy.yaml"),
           "--host", "127.0.0.1", "--port", str(free_port()), "--max-total-tokens", "16384",
           "--skip-server-warmup"]
    rows = []
    with VLLMServer(cmd, env=server_env(), log_path=tmp / "sglang.log") as srv:
        for text in prompts[span(a.eval)]:
            ids = tok(text).input_ids
            n = -(-(len(ids) + a.max_new_tokens) // 16) * 16 - len(ids)  # whole blocks
            ref = generate(model, ids, params, n)
            fast = spiffy_generate(model, ids, graph, params, n, keep=a.keep)
            before = srv.log_path.read_text().count("Prefill batch")
            status, body = request(f"{srv.url}/generate", {
                "input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}})
            assert status == 200, body
            time.sleep(0.5)  # the scheduler logs a forward just after streaming its output
            log = srv.log_path.read_text()
            blocks = [m for m in BLOCK.finditer(log) if m.group(1) == body["meta_info"]["id"]]
            forwards = sum(int(m.group(2)) for m in blocks)
            steps = sum(int(m.group(3)) for m in blocks)
            logged = log.count("Prefill batch") - before - len(ids) // 16
            rows.append({
                "prompt_tokens": len(ids), "new_tokens": len(ref.tokens), "blocks": len(blocks),
                "identical": body["output_ids"] == ref.tokens == fast.tokens,
                "sglang_forwards": forwards, "sglang_logged_forwards": logged,
                "one_step_forwards": steps + len(blocks), "steps": steps,
                "accepted": sum(int(m.group(4)) for m in blocks),
                "reference_vanilla_nfe": ref.nfe, "reference_spiffy_nfe": fast.nfe})
            print(rows[-1], flush=True)
    total = {k: sum(r[k] for r in rows) for k in rows[0] if k != "identical"}
    total["identical"] = all(r["identical"] for r in rows)
    total["reduction_vs_one_step"] = round(total["one_step_forwards"] / total["sglang_forwards"], 3)
    print("total", total)
    if a.out:
        write_json(a.out, {"args": vars(a), "graph_nodes": len(graph.nodes), "rows": rows,
                           "total": total})


if __name__ == "__main__":
    main()
