"""Test runs in subprocesses: several pytest commands at once (one core each on the 2-core CI
machine while the parent waits), and each check's outcome from a run's JUnit XML."""

import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_at_once(cmds: list[list[str]], env: dict, timeout: int = 1800) -> list[tuple]:
    """[(returncode, stdout, stderr)] of each command, all started together in the repo root;
    any still running at the timeout (or when this raises) is killed."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for cmd in cmds]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def junit_results(xml: Path, qualified: bool = False) -> dict[str, tuple[str, str]]:
    """{check: ("passed" | "failed" | "skipped", text)} of one JUnit file; a check is its test
    name, or `file_stem::name` with `qualified`."""
    results = {}
    for case in ET.parse(xml).iter("testcase"):
        name = case.get("name")
        if qualified:
            name = f"{case.get('classname').rsplit('.', 1)[-1]}::{name}"
        bad = case.find("failure")  # (Elements without children are falsy: no `or` here)
        bad = case.find("error") if bad is None else bad
        skip = case.find("skipped")
        results[name] = ("failed", bad.text) if bad is not None else (
            ("skipped", skip.get("message")) if skip is not None else ("passed", ""))
    return results
