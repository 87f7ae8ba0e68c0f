"""The packages' import graph: no cycles between modules (imports at module level and inside
functions both count), and the layering holds: `kernels` imports no package of ours,
`dflash_plugin` and `spiffy_plugin` import neither each other nor `specfold_plugin`, and no core
module imports an engine (vllm / sglang imports live only in `*/engines/`)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kernels": "specdec_kernels", "dflash_plugin": "dflash_plugin",
            "spiffy_plugin": "spiffy_plugin", "specfold_plugin": "specfold_plugin"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((name, *parts))] = path
    return out


def _imports(module: str, path: Path) -> set[str]:
    """Every module named by an import statement anywhere in the file (absolute names)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {n for n in _imports(m, p) if n in mods and n != m} for m, p in mods.items()}


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_layering():
    mods = _modules()
    allowed = {"specdec_kernels": {"specdec_kernels"},
               "dflash_plugin": {"specdec_kernels", "dflash_plugin"},
               "spiffy_plugin": {"specdec_kernels", "spiffy_plugin"},
               "specfold_plugin": {"specdec_kernels", "spiffy_plugin", "specfold_plugin"}}
    bad = []
    for m, path in mods.items():
        top = m.split(".")[0]
        for name in _imports(m, path):
            head = name.split(".")[0]
            if head in allowed and head not in allowed[top]:
                bad.append(f"{m} imports {name}")
            if head in ("vllm", "sglang") and ".engines" not in m:
                bad.append(f"{m} (not an engine adapter) imports {name}")
    assert not bad, bad
