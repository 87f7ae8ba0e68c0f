"""Clean virtual environments for the install tests (test_install.py, test_docker.py).

`build_wheel` builds this checkout's wheel once per session from a clean copy of its files.
`Venv` is a fresh venv in a tmp dir; `host=True` runs let it see .venv's torch, appended after
its own site-packages through a filtered copy that leaves out .venv's install of this project.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST_SITE = Path(sysconfig.get_paths()["purelib"])  # .venv's site-packages under pytest
HOST_VAR = "SPECDEC_TEST_HOST_SITE"
OUR_TOPS = ("specdec_kernels", "kernels", "dflash_plugin", "spiffy_plugin", "specfold_plugin")
HF_KERNELS = "kernels==0.14.1"
_cache: dict[str, Path] = {}


def sh(cmd, cwd=None, env=None, timeout=300) -> str:
    """Run `cmd` (a list, or a str for bash); return its stdout; on failure raise with both."""
    shell = isinstance(cmd, str)
    proc = subprocess.run(["bash", "-c", cmd] if shell else cmd, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        out = (proc.stdout + proc.stderr)[-4000:]
        raise AssertionError(f"exit {proc.returncode}: {cmd}\n{out}")
    return proc.stdout


def copy_paths(dest: Path, paths=None) -> Path:
    """Copy the checkout's files (tracked + untracked, not ignored; no model weights), or only
    those under `paths`, to dest."""
    listed = sh(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT).split("\0")
    for rel in filter(lambda r: r and not r.endswith(".safetensors"), listed):
        if paths is None or any(rel == p or rel.startswith(p.rstrip("/") + "/") for p in paths):
            src = ROOT / rel
            if src.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    return dest


def build_wheel(tmp_path_factory) -> Path:
    """This checkout's wheel (offline: no deps, no build isolation), built once per session."""
    if "wheel" not in _cache:
        tmp = tmp_path_factory.mktemp("wheel")
        src = copy_paths(tmp / "src")  # a clean tree: no stale build/ of the working tree
        sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "--no-index", "-w", str(tmp / "dist"), str(src)])
        (_cache["wheel"],) = (tmp / "dist").glob("specdec_plugins-*.whl")
    return _cache["wheel"]


def wheel_files(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def hf_wheelhouse(tmp_path_factory) -> Path:
    """Hugging Face `kernels` and its dependencies from PyPI, downloaded once per session."""
    if "wheelhouse" not in _cache:
        dest = tmp_path_factory.mktemp("wheelhouse")
        sh([sys.executable, "-m", "pip", "download", "-q", "-d", str(dest), HF_KERNELS])
        _cache["wheelhouse"] = dest
    return _cache["wheelhouse"]


def host_farm(tmp_path_factory) -> Path:
    """Links to .venv's site-packages entries, less this project, its editable finder, any
    `kernels` and all .pth files: what a clean venv may see of .venv (torch and its deps)."""
    if "farm" not in _cache:
        farm = tmp_path_factory.mktemp("host-site")
        for entry in HOST_SITE.iterdir():
            name = entry.name
            if (name.endswith(".pth") or name.startswith(("__editable__", "specdec_plugins"))
                    or name.split("-")[0].split(".")[0] in OUR_TOPS or name == "__pycache__"):
                continue
            (farm / name).symlink_to(entry)
        _cache["farm"] = farm
    return _cache["farm"]


class Venv:
    """A fresh venv at `path` (with pip) made from the interpreter running the tests."""

    def __init__(self, path: Path, farm: Path | None = None):
        sh([sys.executable, "-m", "venv", str(path)])
        self.path, self.bin, self.farm = path, path / "bin", farm
        self.python = self.bin / "python"
        self.site = Path(self.run("import sysconfig; print(sysconfig.get_paths()['purelib'])"))
        if farm is not None:  # appended after the venv's own site-packages, only when asked
            (self.site / "zz_specdec_host.pth").write_text(
                f"import os, sys; p = os.environ.get({HOST_VAR!r}); "
                "p and p not in sys.path and sys.path.append(p)\n")

    def env(self, host: bool = False) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", HOST_VAR)}
        env.update(VIRTUAL_ENV=str(self.path), PATH=f"{self.bin}{os.pathsep}{env['PATH']}")
        if host:
            env[HOST_VAR] = str(self.farm)
        return env

    def run(self, code: str, host: bool = False) -> str:
        """`python -c code`, run from the venv's folder (the checkout's `kernels/` must not be
        on sys.path as the current directory)."""
        return sh([str(self.python), "-c", code], cwd=self.path, env=self.env(host)).strip()

    def shell(self, cmd: str, cwd=None) -> str:
        """A shell command with this venv first on PATH (`python3`, `pip` are the venv's)."""
        return sh(cmd, cwd=cwd or self.path, env=self.env())

    def pip(self, *args: str) -> str:
        return sh([str(self.python), "-m", "pip", *args], cwd=self.path, env=self.env())

    def packages(self) -> dict[str, str]:
        rows = json.loads(self.pip("list", "--format=json", "--disable-pip-version-check"))
        return {r["name"].lower().replace("_", "-"): r["version"] for r in rows}

    def inside(self, path: str) -> bool:
        return Path(path).resolve().is_relative_to(self.path.resolve())
