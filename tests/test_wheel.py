"""graphserve as a user installs it: the built wheel in a fresh virtual environment, beside the newest
transformers and Hugging Face's `kernels` package (whose top-level name our kernels/ folder shares).

The wheel installs one top-level module, `graphserve`; from the repository root and from any other
folder, transformers imports as it should and the `graphserve` command runs; from the repository root
(where our kernels/ and server/ folders sit beside the wheel's), `graphserve serve` starts on the
embedded model and answers the official openai client. The environment is built once per test run, in the
background from the start of the run (tests/wheel_env.py; torch installs from the machine's local file, the
rest from pip's cache)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

OpenAI = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server").OpenAI

import wheel_env as wheel_env_build

from graphserve.engine.model_files.default_model import MODEL_NAME
from live_server import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
# The folders pyproject maps into the graphserve package, and where they land in it.
PACKAGE_FOLDERS = {"src/graphserve": "graphserve", "server": "graphserve/server", "engine": "graphserve/engine",
                   "kernels": "graphserve/kernels", "configs": "graphserve/configs"}
# Each import resolves to the distribution that owns the name, not to a folder of the repository.
IMPORT_CHECK = """
import transformers, kernels, graphserve, graphserve.server.app, graphserve.engine.core.engine_core
from transformers import LlamaConfig
for module in (transformers, kernels, graphserve):
    assert "site-packages" in module.__file__, module.__file__
print(transformers.__version__, LlamaConfig.model_type)
from graphserve.engine.cpu import attention, quant_linear  # built from the C sources the wheel carries
assert attention.LIBRARY.isa() and quant_linear.LIBRARY.isa()
"""


@pytest.fixture(scope="module")
def wheel_env() -> tuple[Path, str]:
    """(the wheel, a fresh venv's python with it installed): tests/wheel_env.py, started by conftest
    when the run began."""
    return wheel_env_build.ready()


@pytest.fixture(scope="module")
def wheel(wheel_env) -> Path:
    return wheel_env[0]


@pytest.fixture(scope="module")
def wheel_python(wheel_env) -> str:
    return wheel_env[1]


def test_the_wheel_holds_graphserve_only_and_every_source_file(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"graphserve", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, top_level
    top_level_txt = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level_txt).decode().split() == ["graphserve"]
    tracked = subprocess.run(["git", "ls-files", *PACKAGE_FOLDERS], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    wanted = [f for f in tracked if f.endswith((".py", ".toml", ".c", ".h"))]  # C: the CPU kernels' sources
    assert len(wanted) > 50
    for folder, package in PACKAGE_FOLDERS.items():
        for path in (p for p in wanted if p.startswith(folder + "/")):
            assert package + path[len(folder):] in names, f"{path} is not in the wheel: add its folder to pyproject"


@pytest.mark.parametrize("where", ["repository root", "another folder"])
def test_the_installed_wheel_imports_and_serves(wheel_python, where, tmp_path):
    cwd = ROOT if where == "repository root" else tmp_path
    # bytecode written: the venv was installed without it, and each of this test's processes would
    # otherwise compile torch and transformers again as it imports them (a few seconds each)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    checked = subprocess.run([wheel_python, "-c", IMPORT_CHECK], cwd=cwd, env=env, capture_output=True, text=True,
                             timeout=300)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.split()[1] == "llama"

    script = Path(wheel_python).with_name("graphserve")
    help_text = subprocess.run([str(script), "--help"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert help_text.returncode == 0 and "serve" in help_text.stdout, help_text.stderr
    if where != "repository root":  # served once, from where our own folders could shadow the wheel's
        return

    # as a user runs it: without the Triton interpreter that conftest turns on for every other process
    with ServerProcess(["--max-model-len", "256", "--max-num-seqs", "2"], python=wheel_python, cwd=cwd,
                       env={"TRITON_INTERPRET": "0", "PYTHONDONTWRITEBYTECODE": ""}) as server:
        server.wait_ready()
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        completion = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=4,
                                               temperature=0)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 4
    assert completion.choices[0].text.strip()
