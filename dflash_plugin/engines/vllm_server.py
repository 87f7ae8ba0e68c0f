"""Start, query and stop vLLM's OpenAI-compatible server (a subprocess; no vLLM import here).

Used by `make demo`, the engine tests and benchmarks. The server runs in its own process group on
127.0.0.1 and is always stopped by its PID (the whole group), also when the caller fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(target: str, draft: str | None = None, num_speculative_tokens: int = 15,
                  port: int = 8000, extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
           "--host", "127.0.0.1", "--port", str(port), *extra]
    if draft:
        spec = {"method": "dflash", "model": draft,
                "num_speculative_tokens": num_speculative_tokens}
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


def cpu_env() -> dict[str, str]:
    """Environment for vLLM on CPU: small KV cache, a private compile cache."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    return env


def request(url: str, payload: dict | None = None, timeout: float = 300) -> tuple[int, object]:
    """GET (payload None) or POST JSON; returns (HTTP status, parsed JSON or text)."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, body = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, body = err.code, err.read().decode()
    try:
        return status, json.loads(body)
    except json.JSONDecodeError:
        return status, body


def spec_metrics(base_url: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters from /metrics (summed over label sets); per-position
    accepted counts under 'accepted_per_pos' keys 'pos0', 'pos1', ..."""
    _, text = request(f"{base_url}/metrics")
    return parse_spec_metrics(str(text))


def parse_spec_metrics(text: str) -> dict[str, float]:
    """`vllm:spec_decode_*_total` samples of a Prometheus text exposition, parsed by
    prometheus_client (a vLLM dependency): {"num_drafts": ..., "num_accepted_tokens_per_pos.pos0":
    ..., ...}, each summed over its other labels (engine, model)."""
    from prometheus_client.parser import text_string_to_metric_families

    prefix, suffix = "vllm:spec_decode_", "_total"
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not (sample.name.startswith(prefix) and sample.name.endswith(suffix)):
                continue
            name = sample.name[len(prefix):-len(suffix)]
            pos = sample.labels.get("position")
            key = f"{name}.pos{pos}" if pos is not None else name
            out[key] = out.get(key, 0.0) + sample.value
    return out


class VLLMServer:
    """`with VLLMServer(cmd, env) as srv: srv.url ...` — waits for /health, always stops."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None,
                 log_path: str | Path | None = None, startup_timeout: float = 300):
        self.cmd, self.env, self.timeout = cmd, env or cpu_env(), startup_timeout
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path or tempfile.mktemp(prefix="vllm-", suffix=".log"))
        self.proc: subprocess.Popen | None = None
        self.startup_seconds = 0.0

    def start(self) -> VLLMServer:
        log = open(self.log_path, "w")  # noqa: SIM115 (kept open for the child's lifetime)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        while time.perf_counter() - t0 < self.timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {self.proc.returncode} during "
                                   f"start-up; log tail:\n{self.log_tail()}")
            try:
                if request(f"{self.url}/health", timeout=5)[0] == 200:
                    self.startup_seconds = time.perf_counter() - t0
                    return self
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"vLLM server not healthy after {self.timeout} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text()[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> VLLMServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def complete(self, prompt: str, max_tokens: int, **kw) -> tuple[int, object]:
        payload = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens,
                   "temperature": 0.0, **kw}
        return request(f"{self.url}/v1/completions", payload)

    def complete_all(self, prompts: list[str], max_tokens: int) -> tuple[list[str], float]:
        """Greedy completions one after another: their texts and the tokens/s achieved."""
        texts, tokens, t0 = [], 0, time.perf_counter()
        for p in prompts:
            status, body = self.complete(p, max_tokens)
            if status != 200:
                raise RuntimeError(f"completion failed with HTTP {status}: {body}")
            texts.append(body["choices"][0]["text"])
            tokens += body["usage"]["completion_tokens"]
        return texts, tokens / (time.perf_counter() - t0)

    def chat(self, messages: list[dict], max_tokens: int, **kw) -> tuple[int, object]:
        payload = {"model": self.model_name, "messages": messages, "max_tokens": max_tokens,
                   "temperature": 0.0, **kw}
        return request(f"{self.url}/v1/chat/completions", payload)

    @property
    def model_name(self) -> str:
        return self.cmd[self.cmd.index("--model") + 1]
