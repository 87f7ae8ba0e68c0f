"""The built wheel next to Hugging Face's `kernels` (kernels==0.14.1 from PyPI) in clean venvs.

Our Triton kernels install as `specdec_kernels`: the wheel must never ship a top-level `kernels/`.
Both install orders leave HF's `kernels.get_kernel` and our `specdec_kernels.reference` working,
and uninstalling us leaves HF's `kernels` intact. Slow-ish (PyPI download, two venvs): ~35 s.
"""

import json

import pytest

from tests.install_env import HF_KERNELS, Venv, build_wheel, hf_wheelhouse, host_farm, wheel_files

PROBE = "import kernels; print(kernels.get_kernel)"
CHECK = """
import importlib.metadata as md, json, kernels, specdec_kernels, specdec_kernels.reference, torch
print(json.dumps({"kernels": kernels.__file__, "kernels_version": md.version("kernels"),
                  "specdec_kernels": specdec_kernels.__file__, "torch": torch.__file__,
                  "reference": specdec_kernels.reference.__file__}))
"""
GONE = """
import importlib.util, json
print(json.dumps([m for m in ("specdec_kernels", "dflash_plugin", "spiffy_plugin",
                              "specfold_plugin") if importlib.util.find_spec(m)]))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return build_wheel(tmp_path_factory)


@pytest.fixture
def venv(tmp_path, tmp_path_factory):
    return Venv(tmp_path / "venv", host_farm(tmp_path_factory))


def install_hf(venv: Venv, tmp_path_factory) -> None:
    venv.pip("install", "-q", "--no-index", "--find-links", str(hf_wheelhouse(tmp_path_factory)),
             HF_KERNELS)


def assert_both_work(venv: Venv) -> None:
    probe = venv.run(PROBE)
    print(f"{PROBE!r} -> {probe}")
    info = json.loads(venv.run(CHECK, host=True))
    msg = f"python -c {PROBE!r} -> {probe!r}; {info}"
    assert probe.startswith("<function get_kernel"), msg
    assert info["kernels_version"] == "0.14.1" and venv.inside(info["kernels"]), msg
    assert venv.inside(info["specdec_kernels"]) and venv.inside(info["reference"]), msg
    assert not venv.inside(info["torch"]), msg  # .venv's torch, seen through the filtered links


def test_wheel_ships_specdec_kernels_not_kernels(wheel):
    names = wheel_files(wheel)
    tops = sorted({n.split("/")[0] for n in names})
    assert "kernels" not in tops, f"the wheel ships a top-level kernels/ (HF's name): {tops}"
    assert {"specdec_kernels/__init__.py", "specdec_kernels/reference.py"} <= set(names), tops
    assert not [n for n in names if n.startswith("kernels/")], tops


def test_hf_kernels_then_ours(venv, wheel, tmp_path_factory):
    install_hf(venv, tmp_path_factory)
    venv.pip("install", "-q", "--no-deps", str(wheel))
    assert_both_work(venv)


def test_ours_then_hf_kernels_then_uninstall_ours(venv, wheel, tmp_path_factory):
    venv.pip("install", "-q", "--no-deps", str(wheel))
    install_hf(venv, tmp_path_factory)
    assert_both_work(venv)
    venv.pip("uninstall", "-y", "specdec-plugins")
    probe = venv.run(PROBE)
    print(f"after uninstall: {PROBE!r} -> {probe}")
    assert probe.startswith("<function get_kernel"), f"python -c {PROBE!r} -> {probe!r}"
    assert json.loads(venv.run(GONE, host=True)) == [], "our packages are still importable"
    assert "specdec-plugins" not in venv.packages()
