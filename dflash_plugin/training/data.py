"""Training data: the target's own continuations of prompts, stored as token-id shards.

A *prompt* is text (from a JSONL file, or the first / a random run of k lines cut from a Python
source file, right-stripped). `make_data` writes `shard-NNNNN.pt` files, each holding the
concatenated int32 ids of prompt + response for `shard_size` prompts, with their offsets and
prompt lengths, plus `manifest.json`. A rerun with the same settings skips finished shards.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import ConfigError, require

HELD_OUT = ("/sympy/", "/networkx/", "/scipy/")


def load_prompts_jsonl(path: str | Path) -> list[str]:
    path = Path(path)
    require(path.is_file(), "prompts", f"file not found: {path}")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError("prompts", f"{path}:{n} is not valid JSON ({err.msg})") from None
        require(isinstance(row, dict) and isinstance(row.get("prompt"), str), "prompts",
                f"{path}:{n} needs a string field 'prompt'")
        prompts.append(row["prompt"])
    require(len(prompts) > 0, "prompts", f"{path} holds no prompts")
    return prompts


def code_files(roots: list[str | Path], exclude: tuple[str, ...] = HELD_OUT,
               max_bytes: int = 200_000) -> list[Path]:
    """Python files under `roots`, skipping any path that contains an excluded fragment."""
    files = []
    for root in roots:
        for f in sorted(Path(root).rglob("*.py")):
            s = str(f)
            if any(x in s for x in exclude) or not f.is_file():
                continue
            if 0 < f.stat().st_size <= max_bytes:
                files.append(f)
    return files


def cut_code_prompts(files: list[Path], per_file: int, seed: int, min_lines: int = 20,
                     max_lines: int = 60) -> list[str]:
    """`per_file` prompts per file: the first k lines, then random runs of k lines."""
    rng = random.Random(seed)
    out = []
    for f in files:
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        for i in range(per_file):
            k = rng.randint(min_lines, max_lines)
            if len(lines) < k + 10:
                break
            start = 0 if i == 0 else rng.randint(0, len(lines) - k - 10)
            text = "\n".join(lines[start:start + k]).rstrip()
            if text:
                out.append(text)
    rng.shuffle(out)
    return out


def _generate(model, rows: list[list[int]], max_new: int, temperature: float, top_p: float,
              eos: int | None, pad: int) -> list[list[int]]:
    device = model.get_input_embeddings().weight.device
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    kw = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 \
        else {"do_sample": False}
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                         max_new_tokens=max_new, eos_token_id=eos, pad_token_id=pad, **kw)
    gen = out[:, width:].tolist()
    if eos is not None:
        gen = [g[:g.index(eos) + 1] if eos in g else g for g in gen]
    return gen


def _fast_generator(model, batch_size: int, max_len: int):
    """Greedy continuations through the static-cache runtime (`dflash_plugin.fast`, CUDA graphs
    on GPU): the same tokens as Hugging Face `generate`, without its per-token host overhead."""
    from ..fast import build_decoder, fast_generate

    dec = build_decoder(model, batch=batch_size, max_len=max_len, max_block=1,
                        graphs=model.device.type == "cuda")

    def run(_model, rows, max_new, temperature, top_p, eos, pad):
        stops = () if eos is None else (eos,)
        return fast_generate(dec, rows, block_size=1, max_new_tokens=max_new,
                             stop_token_ids=stops, proposer="ar").tokens
    return run


def make_data(model, tokenizer, prompts: list[str], out_dir: str | Path, *,
              max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
              shard_size: int = 1024, batch_size: int = 64, max_prompt_tokens: int = 1024,
              seed: int = 0, fast: bool = False) -> Path:
    """Write target continuations of `prompts` to shards under `out_dir` (resumable). `fast`
    generates greedy continuations with the static-cache runtime instead of HF `generate`."""
    require(max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {max_new_tokens}")
    require(temperature >= 0, "temperature", f"must be >= 0, got {temperature}")
    require(not fast or temperature == 0, "fast", "the fast runtime generates greedily only; "
            "use temperature 0 or drop --fast")
    require(len(prompts) > 0, "prompts", "no prompts given")
    generate = _fast_generator(model, batch_size, max_prompt_tokens + max_new_tokens + 1) if fast \
        else _generate
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"num_prompts": len(prompts), "shard_size": shard_size,
                "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                "max_prompt_tokens": max_prompt_tokens, "seed": seed}
    manifest = out / "manifest.json"
    if manifest.is_file():
        old = json.loads(manifest.read_text())
        require(old == settings, "out", f"{out} holds data made with other settings: {old}")
    manifest.write_text(json.dumps(settings, indent=2))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = pad if pad is not None else (eos or 0)
    n_shards = (len(prompts) + shard_size - 1) // shard_size
    bar = tqdm(total=len(prompts), desc="make-data", unit="prompt")
    for s in range(n_shards):
        chunk = prompts[s * shard_size:(s + 1) * shard_size]
        path = out / f"shard-{s:05d}.pt"
        if path.is_file():
            bar.update(len(chunk))
            continue
        torch.manual_seed(seed * 100_003 + s)
        encoded = [tokenizer(p).input_ids[-max_prompt_tokens:] for p in chunk]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        responses: list[list[int]] = [[] for _ in encoded]
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            gens = generate(model, [encoded[j] for j in idx], max_new_tokens, temperature,
                            top_p, eos, pad)
            for j, g in zip(idx, gens):
                responses[j] = g
            bar.update(len(idx))
        save_shard(path, encoded, responses)
    bar.close()
    return out


def save_shard(path: str | Path, prompts: list[list[int]], responses: list[list[int]]) -> None:
    """One shard: concatenated int32 ids of prompt + response, offsets, prompt lengths."""
    path = Path(path)
    seqs = [torch.tensor(p + r, dtype=torch.int32) for p, r in zip(prompts, responses)]
    lens = torch.tensor([len(x) for x in seqs])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    tmp = path.with_suffix(".tmp")
    torch.save({"tokens": torch.cat(seqs), "offsets": offsets,
                "prompt_lens": torch.tensor([len(p) for p in prompts])}, tmp)
    tmp.rename(path)  # a shard exists only once complete, so reruns can skip it


class TokenDataset:
    """All sequences of one or more data folders, in memory: (ids, prompt_len) per index."""

    def __init__(self, folders: list[str | Path], min_response: int = 1):
        self.seqs: list[torch.Tensor] = []
        self.prompt_lens: list[int] = []
        for folder in folders:
            shards = sorted(Path(folder).glob("shard-*.pt"))
            require(len(shards) > 0, "data", f"no shard-*.pt files in {folder}")
            for shard in shards:
                blob = torch.load(shard)
                offs = blob["offsets"].tolist()
                for i, p in enumerate(blob["prompt_lens"].tolist()):
                    seq = blob["tokens"][offs[i]:offs[i + 1]].long()
                    if len(seq) - p >= min_response:
                        self.seqs.append(seq)
                        self.prompt_lens.append(p)
        require(len(self.seqs) > 0, "block_size",
                f"no sequence has a response of at least {min_response} tokens; lower the "
                f"block size or generate longer responses")

    def __len__(self) -> int:
        return len(self.seqs)

    def batch(self, indices: list[int], max_len: int):
        """Right-padded ids [b, L], lengths [b], prompt lengths [b] (long sequences keep their
        last `max_len` tokens)."""
        rows, plens = [], []
        for i in indices:
            seq, p = self.seqs[i], self.prompt_lens[i]
            cut = max(0, len(seq) - max_len)
            rows.append(seq[cut:])
            plens.append(max(0, p - cut))
        lengths = torch.tensor([len(r) for r in rows])
        ids = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
        return ids, lengths, torch.tensor(plens)
