"""The bundled fixtures are the published ones: every file matches `examples/fixtures/SHA256SUMS`,
and every file of a fixture folder is listed there (nothing added, nothing changed)."""

import hashlib
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "examples" / "fixtures"


def _sums() -> dict[str, str]:
    lines = (FIXTURES / "SHA256SUMS").read_text().splitlines()
    return {name: digest for digest, name in (line.split(maxsplit=1) for line in lines if line)}


def test_every_fixture_file_matches_its_digest():
    sums = _sums()
    assert {"code-target/config.json", "code-dllm/config.json",
            "code-target-dflash-b16/model.safetensors", "dev-prompts.jsonl"} <= set(sums)
    for name, digest in sums.items():
        got = hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest()
        assert got == digest, f"{name}: sha256 {got} != {digest} in SHA256SUMS"


def test_no_unlisted_model_files():
    sums = _sums()
    for folder in ("code-target", "code-dllm", "code-target-dflash-b16"):
        files = {f"{folder}/{p.name}" for p in (FIXTURES / folder).iterdir() if p.is_file()}
        assert files <= set(sums), f"unlisted: {sorted(files - set(sums))}"
