"""`make demo`: serve the bundled code target with its trained DFlash drafter through vLLM's
OpenAI-compatible server, send completion and chat requests, and compare with the same server
without speculation (text identity, tokens/s, tau from vLLM's own /metrics).

Usage: python examples/vllm_demo.py [--target DIR] [--draft DIR] [--max-tokens N] [--cpu]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_plugin.engines.vllm_server import VLLMServer, free_port, serve_command, spec_metrics

HERE = Path(__file__).resolve().parent
PROMPTS = [
    "import numpy as np\n\n\ndef softmax(x, axis=-1):",
    "class Stack:\n    \"\"\"A last-in first-out container.\"\"\"\n\n    def __init__(self):",
    "def read_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"",
]
CHAT = [{"role": "user", "content": "import os\n\n\ndef list_python_files(root):"}]


def run(server: VLLMServer, max_tokens: int) -> dict:
    texts, tps = server.complete_all(PROMPTS, max_tokens)
    status, body = server.chat(CHAT, max_tokens)
    assert status == 200, body
    return {"texts": texts, "chat": body["choices"][0]["message"]["content"],
            "tokens_per_second": tps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default=str(HERE / "fixtures" / "code-target"))
    p.add_argument("--draft", default=str(HERE / "fixtures" / "code-target-dflash-b16"))
    p.add_argument("--num-speculative-tokens", type=int, default=15)
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()
    extra = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
             "--chat-template", str(HERE / "chat_template.jinja"))
    results = {}
    for name, draft in (("dflash", args.draft), ("plain", None)):
        cmd = serve_command(args.target, draft, args.num_speculative_tokens, free_port(), extra)
        print(f"starting vLLM ({name}) on 127.0.0.1 ...", flush=True)
        with VLLMServer(cmd) as srv:
            m0 = spec_metrics(srv.url)
            results[name] = run(srv, args.max_tokens)
            m1 = spec_metrics(srv.url)
            results[name]["startup_seconds"] = srv.startup_seconds
            if draft:
                drafts = m1["num_drafts"] - m0["num_drafts"]
                acc = m1["num_accepted_tokens"] - m0["num_accepted_tokens"]
                results[name]["tau"] = 1 + acc / max(drafts, 1)
    spec, plain = results["dflash"], results["plain"]
    for prompt, text in zip(PROMPTS, spec["texts"]):
        print("=" * 72 + f"\n{prompt}{text}")
    print("=" * 72 + f"\n[chat] {CHAT[0]['content']}\n{spec['chat']}\n" + "=" * 72)
    same = spec["texts"] == plain["texts"] and spec["chat"] == plain["chat"]
    print(f"vLLM start-up: {spec['startup_seconds']:.0f} s with DFlash, "
          f"{plain['startup_seconds']:.0f} s without")
    print(f"tau (vLLM /metrics, 1 + accepted per draft): {spec['tau']:.2f}")
    print(f"tokens/s on this machine: {spec['tokens_per_second']:.1f} with DFlash, "
          f"{plain['tokens_per_second']:.1f} without (ratio "
          f"{spec['tokens_per_second'] / plain['tokens_per_second']:.2f})")
    print(f"greedy outputs token-identical with and without speculation: {same}")


if __name__ == "__main__":
    main()
