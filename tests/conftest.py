import os

import torch

# Triton kernels run in interpreter mode on machines with no GPU; this must be set
# before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # no warm-up burst before ready (engine/core/warm_up.py) unless a test asks for one: on the CPU it only
    # loads the grammar vocabulary, and the suite's engines and servers would spend 75 s of a CI run on it
    os.environ.setdefault("GRAPHSERVE_WARM_UP", "0")

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
