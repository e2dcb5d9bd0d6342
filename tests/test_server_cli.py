"""The `graphserve` command: settings from configs/*.toml and flags, `serve` as a real
process streaming to a curl-style request, `generate`, `prepare-model`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")

from graphserve.engine.config import EngineConfig
from graphserve.server.cli import build_parser, load_settings, main
from graphserve.server.settings import (
    SettingsError,
    default_config_path,
    parse_size,
    read_config_file,
    repo_configs_dir,
    resolve_config_path,
)
from live_server import free_port

REPO = Path(__file__).resolve().parent.parent


def settings_for(argv: list[str]):
    return load_settings(build_parser().parse_args(argv))


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "x.toml"
    config.write_text(
        'port = 9000\nmax_num_seqs = 3\n[server]\nhost = "0.0.0.0"\n'
        '[engine]\ndecode_chunk = 4\nkv_cache_bytes = "64MiB"\nenforce_eager = true\n'
    )
    server, engine, path = settings_for(["serve", "--config", str(config), "--port", "9001", "--decode-chunk", "2"])
    assert path == config
    assert (server.host, server.port) == ("0.0.0.0", 9001)
    assert (engine.max_num_seqs, engine.decode_chunk, engine.kv_cache_bytes) == (3, 2, 64 * 1024**2)
    assert engine.enforce_eager is True
    _, engine, _ = settings_for(["serve", "--config", str(config), "--no-enforce-eager"])
    assert engine.enforce_eager is False


def test_every_engine_setting_has_a_flag() -> None:
    parser = build_parser()
    serve_flags = {a.dest for a in parser._subparsers._group_actions[0].choices["serve"]._actions}  # type: ignore[union-attr]
    assert {f.name for f in fields(EngineConfig)} <= serve_flags


def test_unknown_keys_and_bad_values_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("max_num_seqz = 3\n")
    with pytest.raises(SettingsError, match="max_num_seqz"):
        read_config_file(bad)
    assert main(["serve", "--config", str(bad)]) == 2
    assert "max_num_seqz" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.toml")]) == 2
    invalid = tmp_path / "invalid.toml"
    invalid.write_text("block_size = 3\n")
    assert main(["serve", "--config", str(invalid)]) == 2


def test_shipped_configs_are_valid() -> None:
    assert default_config_path() == repo_configs_dir() / "default.toml"
    _, cpu, _ = settings_for(["serve"])
    assert cpu.device in ("auto", "cpu") and cpu.max_num_seqs >= 8
    assert resolve_config_path("gpu-h200") == repo_configs_dir() / "gpu-h200.toml"
    server, gpu, _ = settings_for(["serve", "--config", "gpu-h200"])
    assert (gpu.device, gpu.dtype, gpu.max_num_seqs) == ("cuda", "bfloat16", 256)
    assert gpu.gpu_memory_utilization == pytest.approx(0.9)
    _, two, _ = settings_for(["serve", "--config", "gpu-2xh200"])
    assert (two.device, two.tensor_parallel_size) == ("cuda", 2)
    assert settings_for(["serve", "--tensor-parallel-size", "4"])[1].tensor_parallel_size == 4


def test_api_key_comes_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHSERVE_API_KEY", "from-env")
    assert settings_for(["serve"])[0].api_key == "from-env"
    assert settings_for(["serve", "--api-key", "from-flag"])[0].api_key == "from-flag"


def test_parse_size() -> None:
    assert parse_size(123) == 123
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("2GB") == 2 * 1000**3
    assert parse_size("1.5GiB") == int(1.5 * 1024**3)
    with pytest.raises(SettingsError):
        parse_size("lots")


def test_serve_process_streams_and_drains_on_sigterm() -> None:
    """`graphserve serve`; what `curl -N URL -d '{"prompt":"Hello","stream":true}'` sends;
    then SIGTERM mid-stream: the running stream still ends normally, the process exits 0."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "graphserve",
        "serve",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--max-model-len",
        "256",
        "--kv-cache-bytes",
        "32MiB",
        "--max-num-seqs",
        "4",
    ]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 240
        assert process.stdout is not None
        while not any("graphserve ready" in line for line in lines):
            line = process.stdout.readline()
            assert line or process.poll() is None, "".join(lines)
            lines.append(line)
            assert time.monotonic() < deadline, "".join(lines)
        log = "".join(lines)
        assert f"http://127.0.0.1:{port}/v1" in log and "default.toml" in log
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            assert http.get("/health").status_code == 200
            with http.stream(
                "POST",
                "/v1/completions",
                content=b'{"prompt":"Hello","stream":true}',
                headers={"Content-Type": "application/x-www-form-urlencoded"},
            ) as response:
                assert response.status_code == 200
                events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert len(chunks) >= 2, "several events, one per engine round"
            assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

            body = {
                "prompt": "Hello",
                "max_tokens": 24,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines_iter = response.iter_lines()
                first = next(line for line in lines_iter if line.startswith("data: "))
                process.send_signal(signal.SIGTERM)  # what `docker stop` sends
                rest = [line[6:] for line in lines_iter if line.startswith("data: ")]
        events = [first[6:], *rest]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 24, "the running request finished"
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0


def test_generate_prints_the_completion() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphserve",
            "generate",
            "The capital of France is",
            "--max-tokens",
            "4",
            "--device",
            "cpu",
            "--max-model-len",
            "128",
            "--kv-cache-bytes",
            "16MiB",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_prepare_model_prints_the_model_folder(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prepare-model"]) == 0
    folder = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()


def _serve_until_exit(model: Path) -> tuple[int, list[str]]:
    result = subprocess.run([sys.executable, "-m", "graphserve", "serve", "--model", str(model), "--port",
                             str(free_port())], capture_output=True, text=True, timeout=120)
    return result.returncode, (result.stdout + result.stderr).strip().splitlines()


@pytest.mark.parametrize("case", ["missing folder", "unknown architecture", "no weights"])
def test_a_model_it_cannot_serve_ends_serve_with_one_line_naming_the_cause(case: str, tmp_path: Path) -> None:
    """`graphserve serve --model X` for an X it cannot serve exits 1, and its last line names the
    cause: found before any process starts (no folder, an architecture it does not implement), or
    by the engine core while it loads (no weights), never the front end's echo of the core's exit."""
    from graphserve.engine.model_files.default_model import default_model_path

    model = tmp_path / "model"
    if case == "unknown architecture":
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    elif case == "no weights":
        model.mkdir()
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (model / name).write_bytes((default_model_path() / name).read_bytes())
    code, lines = _serve_until_exit(model)
    expected = {"missing folder": f"graphserve: model folder not found: {model}",
                "unknown architecture": "graphserve: unsupported model architecture 'GPT2LMHeadModel'; graphserve "
                                        "supports: LlamaForCausalLM,",
                "no weights": f"graphserve: the engine could not start: {model} has no safetensors weights"}[case]
    assert code == 1
    assert lines[-1].startswith(expected), lines[-5:]
    assert not any(line.startswith("Traceback") for line in lines), "\n".join(lines)


def test_serve_ray_without_ray_says_what_to_install_in_one_line() -> None:
    hide_ray = "import sys; sys.modules['ray'] = None; from graphserve.server.cli import main; sys.exit(main())"
    result = subprocess.run([sys.executable, "-c", hide_ray, "serve", "--ray", "--device", "cpu"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 1
    assert lines[-1] == "graphserve: --ray needs Ray Serve: pip install graphserve[ray]", lines[-5:]


def test_serve_ray_takes_a_replica_count_or_autoscaling_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before Ray starts: both at once, or bounds that cannot hold."""
    for flags in (["--replicas", "2", "--max-replicas", "3"], ["--replicas", "0"],
                  ["--min-replicas", "3", "--max-replicas", "2"]):
        assert main(["serve", "--ray", "--device", "cpu", *flags]) == 2, flags
        assert capsys.readouterr().err.startswith("graphserve: ")
