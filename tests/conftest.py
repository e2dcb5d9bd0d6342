import os

import torch

# Triton kernels run in interpreter mode on machines with no GPU; this must be set
# before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import wheel_env  # noqa: E402

pytest_plugins = ["tensor_checks", "server_clients"]  # poisoned_outputs; client, oai and model of a `server`


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")  # a pytest-xdist worker (make test runs two)


def pytest_configure(config):
    if not _is_worker(config):  # the controller names the wheel's folder before its workers start
        wheel_env.claim()


def pytest_collection_finish(session):
    # the installed wheel's environment takes ~40 s of pip: built beside the tests that run first
    # (under xdist by the controller, below, once a worker has collected test_wheel.py)
    if not _is_worker(session.config) and any("wheel_env" in item.fixturenames for item in session.items):
        wheel_env.start()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    if any("test_wheel.py::" in i for i in ids):
        wheel_env.start()


def pytest_sessionfinish(session, exitstatus):
    if not _is_worker(session.config):
        wheel_env.discard()


# make test runs each test file whole on one of two xdist workers (--dist loadfile), handing out files in
# the order collected (--no-loadscope-reorder; xdist would otherwise order them by their number of tests,
# which put the few-test, long files such as the Ray, reliability and wheel tests last, leaving one worker
# alone for minutes). The longest files go first, so the run ends on short ones. Longest first, as measured
# with --durations on this suite; a file not listed keeps its place after these.
LONGEST_FILES_FIRST = (
    "test_kernels.py", "test_supervisor_behaviour.py", "test_moe_kernel.py", "test_processes.py",
    "test_quant_linear.py", "test_reliability.py", "test_ray_serving.py", "test_skinny_gemm.py", "test_cpu_arm.py",
    "test_spec_engine.py", "test_tensor_parallel.py", "test_adversarial.py", "test_request_validation.py",
    "test_fp8_quant.py", "test_streaming.py", "test_structured_outputs.py", "test_gpt_oss_experts.py",
    "test_structured_behaviour.py", "test_models.py", "test_spec_verify.py", "test_server_cli.py",
    "test_server_api.py", "test_lora_embedded.py", "test_server_errors.py", "test_wheel.py", "test_prefix_cache.py",
    "test_embedded_model.py", "test_scale_out_manifests.py",
)


def _longest_first(item) -> int:
    name = item.path.name
    return LONGEST_FILES_FIRST.index(name) if name in LONGEST_FILES_FIRST else len(LONGEST_FILES_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_longest_first)  # stable: a file's tests keep their order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
