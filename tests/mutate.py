"""`make mutate`: mutation testing with cosmic-ray, one session per module (tests/mutate.toml).

cosmic-ray edits the module under test in place and runs a test command against each mutant, so
this never runs in the repository itself: each session copies the working tree (tracked files and
untracked ones git does not ignore, so uncommitted tests count) to WORKDIR/<session>/tree, maps the
`graphserve` namespace onto that copy with a link tree on PYTHONPATH (what pyproject's package-dir
says; the project's venv keeps its own editable install, which PYTHONPATH shadows), and runs the
tests there with the project's Python. cosmic-ray lives in its own venv (WORKDIR/venv); run this
file with it.

    mutate.py --python .venv/bin/python [--session sampler ...] [--workdir DIR] [--jobs 2]
              [--minutes 55 | --stop-at 19:50] [--resume] [--report]

Per session: a baseline run of its tests (they must pass; its time sets the mutants' timeout),
`cosmic-ray init`, the equivalent mutants of the config marked as such, `cosmic-ray exec` (one
process, mutants in random order), then the score: killed (a timeout counts as killed), survived,
equivalent, pending. --jobs sessions run side by side, each in its own copy. --minutes gives the
whole run a time budget: each session gets an equal slot and stops at its end, so what it ran is a
random sample of its mutants, and its score comes with a 95% interval. --stop-at HH:MM (UTC)
interrupts every session then. Either leaves the rest pending; --resume goes on with the copies and
sessions already there. WORKDIR/report.md gets the scores and every survivor's diff.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = Path(__file__).resolve().parent / "mutate.toml"


def snapshot(tree: Path) -> None:
    """Copy the working tree's files (not the ignored ones: venvs, builds, caches) to `tree`."""
    if tree.exists():
        shutil.rmtree(tree)
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if not source.exists() and not source.is_symlink():  # deleted but not yet committed
            continue
        if source.is_dir():  # a submodule or nested repository
            continue
        target = tree / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)


def link_tree(tree: Path, path: Path) -> None:
    """path/<package>/... -> the copy's folders, as pyproject's [tool.setuptools.package-dir] maps them."""
    if path.exists():
        shutil.rmtree(path)
    package_dir = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in sorted(package_dir.items(), key=lambda item: item[0].count(".")):
        target = path.joinpath(*name.split("."))
        if "." not in name:  # the root package: a real folder, its files linked one by one
            target.mkdir(parents=True)
            for entry in (tree / folder).iterdir():
                if entry.name != "__pycache__":
                    (target / entry.name).symlink_to(entry)
        else:
            if target.is_symlink():
                target.unlink()
            target.symlink_to(tree / folder, target_is_directory=True)


def environment(path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH", "")]))
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no stale bytecode of a mutant, nor of the original after it
    env.pop("VIRTUAL_ENV", None)
    return env


def check_mapping(python: str, tree: Path, env: dict[str, str], module: str) -> None:
    """The module under test must be imported from the copy, never from the repository."""
    dotted = "graphserve." + module.removesuffix(".py").replace("/", ".")
    found = subprocess.run([python, "-c", f"import {dotted} as m; print(m.__file__)"], cwd=tree, env=env,
                           check=True, capture_output=True, text=True).stdout.strip()
    if not Path(found).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{dotted} imports from {found}, not from the copy {tree}")


def test_command(python: str, tests: list[str], timeout: float | None = None) -> str:
    args = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not gpu", *tests]
    if timeout is not None:
        args.append(f"--timeout={int(timeout)}")
    return shlex.join(args)


def cosmic_ray_config(modules: list[str], command: str, timeout: float) -> str:
    return "\n".join([
        "[cosmic-ray]",
        f"module-path = {modules!r}".replace("'", '"'),
        f"timeout = {timeout:.0f}",
        "excluded-modules = []",
        f"test-command = {command!r}" if "'" not in command else f'test-command = """{command}"""',
        "",
        "[cosmic-ray.distributor]",
        'name = "local"',
        "",
    ])


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Where the annotations of a module are, when `from __future__ import annotations` keeps them
    unevaluated (else none)."""
    tree = ast.parse(source)
    if not any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
               for n in tree.body):
        return []
    spans = []
    for node in ast.walk(tree):
        found = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            found = [a.annotation for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
                     if a is not None and a.annotation is not None] + ([node.returns] if node.returns else [])
        elif isinstance(node, ast.AnnAssign):
            found = [node.annotation]
        spans += [((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in found]
    return spans


def filter_mutants(db_path: Path, tree: Path, session: dict, entries: list[dict], excluded: list[str]) -> list[dict]:
    """Before exec, record as skipped: the config's equivalent mutants (with their reason), the
    mutants inside annotations nobody evaluates (equivalent), and the operators the config
    excludes. Returns the equivalent entries that matched nothing."""
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    sources: dict[str, list[str]] = {}
    spans: dict[str, list] = {}
    used = [False] * len(entries)
    patterns = [re.compile(p) for p in excluded]
    with use_db(str(db_path)) as db:
        specs = [item.mutations[0] for item in db.work_items]
        survived = [item for item, result in db.completed_work_items if result.test_outcome == TestOutcome.SURVIVED]
        for item in [*db.pending_work_items, *survived]:  # a survivor found equivalent later is re-recorded
            (spec,) = item.mutations
            module = str(spec.module_path)
            if module not in sources:
                text = (tree / module).read_text()
                sources[module] = text.splitlines()
                spans[module] = [] if session.get("annotations_evaluated") else annotation_spans(text)
            start, end = tuple(spec.start_pos), tuple(spec.end_pos)
            line = sources[module][start[0] - 1].strip()
            same_line = sorted(s.occurrence for s in specs if str(s.module_path) == module
                               and s.operator_name == spec.operator_name and s.start_pos[0] == start[0])
            nth = same_line.index(spec.occurrence)
            why = None
            for i, entry in enumerate(entries):
                if (entry["module"] == module and entry["operator"] == spec.operator_name and entry["line"] == line
                        and entry.get("occurrence", nth) == nth):
                    why, used[i] = "equivalent: " + entry["reason"], True
                    break
            if why is None and any(a <= start and end <= b for a, b in spans[module]):
                why = "equivalent: inside an annotation, which `from __future__ import annotations` leaves unevaluated"
            if why is None and item in survived:
                continue
            if why is None and any(p.search(spec.operator_name) for p in patterns):
                why = "excluded: an operator tests/mutate.toml does not run"
            if why is not None:
                db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=why))
    return [e for e, u in zip(entries, used) if not u]


def score(db_path: Path) -> dict:
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    counts = {"mutants": 0, "killed": 0, "timeout": 0, "survived": 0, "equivalent": 0, "excluded": 0, "incompetent": 0,
              "pending": 0}
    survivors = []
    with use_db(str(db_path)) as db:
        results = dict(db.results)
        for item in db.work_items:
            counts["mutants"] += 1
            result = results.get(item.job_id)
            if result is None:
                counts["pending"] += 1
            elif result.worker_outcome == WorkerOutcome.SKIPPED:
                counts["excluded" if (result.output or "").startswith("excluded") else "equivalent"] += 1
            elif result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                spec = item.mutations[0]
                survivors.append(f"{spec.module_path}:{spec.start_pos[0]} {spec.operator_name} "
                                 f"(occurrence {spec.occurrence})\n{result.diff or ''}")
            elif result.test_outcome == TestOutcome.INCOMPETENT:
                counts["incompetent"] += 1
            elif result.output == "timeout":
                counts["timeout"] += 1
            else:
                counts["killed"] += 1
    killed = counts["killed"] + counts["timeout"]
    decided = killed + counts["survived"]
    counts["score"] = f"{100 * killed / decided:.1f}% ({killed}/{decided})" if decided else "n/a"
    if decided and counts["pending"]:  # a random sample of the session's mutants: an estimate
        low, high = wilson_interval(killed, decided)
        counts["score"] += f", 95% interval {100 * low:.0f}-{100 * high:.0f}%"
    return {"counts": counts, "survivors": survivors}


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% interval for a kill rate of k in n mutants drawn at random."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def run_exec(tool_bin: Path, cfg: Path, db: Path, tree: Path, env: dict[str, str], stop_at: dt.datetime | None,
             interrupted: threading.Event) -> bool:
    """cosmic-ray exec until done, `stop_at` or `interrupted`; True when it finished."""
    process = subprocess.Popen([str(tool_bin / "cosmic-ray"), "exec", str(cfg), str(db)], cwd=tree, env=env,
                               start_new_session=True)
    while process.poll() is None:
        if interrupted.is_set() or (stop_at is not None and dt.datetime.now(dt.UTC) >= stop_at):
            tests = _children(process.pid)  # the running test command: its own session, out of reach of SIGINT
            os.killpg(process.pid, signal.SIGINT)  # cosmic-ray puts the module back, records nothing for it
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            for pid in tests:
                try:
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return False
        interrupted.wait(2)
    if process.returncode != 0:
        raise SystemExit(f"cosmic-ray exec exited with {process.returncode}")
    return True


@dataclass(frozen=True)
class Run:
    """What every session of one `make mutate` shares."""

    config: dict
    python: str
    tool_bin: Path
    workdir: Path
    fresh: bool  # new copies and sessions (not --resume / --report)
    report_only: bool
    interrupted: threading.Event


def run_session(run: Run, name: str, stop_at: dt.datetime | None) -> tuple[bool, list[str]]:
    """One session in its own copy of the tree, until done or `stop_at`: (finished, report lines)."""
    session = run.config["session"][name]
    started = dt.datetime.now(dt.UTC)
    folder = run.workdir / name
    tree, path = folder / "tree", folder / "path"
    cfg, db = folder / "session.toml", folder / "session.sqlite"
    if run.report_only and not db.exists():
        return True, [f"## {name}: not run", ""]
    if run.fresh or not tree.exists():
        print(f"[{name}] copying the working tree to {tree}", flush=True)
        snapshot(tree)
    link_tree(tree, path)
    env = environment(path)
    check_mapping(run.python, tree, env, session["modules"][0])
    mine = [e for e in run.config.get("equivalent", []) if e["module"] in session["modules"]]
    excluded = run.config["tool"].get("exclude_operators", [])
    if run.fresh or not db.exists():
        print(f"[{name}] baseline: {' '.join(session['tests'])}", flush=True)
        start = time.monotonic()
        baseline = subprocess.run(shlex.split(test_command(run.python, session["tests"])), cwd=tree, env=env,
                                  check=False, stdout=subprocess.DEVNULL)
        took = time.monotonic() - start
        if baseline.returncode != 0:
            raise SystemExit(f"[{name}] the tests fail without any mutation (exit {baseline.returncode})")
        timeout = max(run.config["tool"]["timeout_min"], run.config["tool"]["timeout_factor"] * took)
        print(f"[{name}] baseline {took:.0f} s; timeout per mutant {timeout:.0f} s", flush=True)
        cfg.write_text(cosmic_ray_config(session["modules"], test_command(run.python, session["tests"], timeout),
                                         timeout))
        subprocess.run([str(run.tool_bin / "cosmic-ray"), "init", "--force", str(cfg), str(db)], cwd=tree, env=env,
                       check=True, stdout=subprocess.DEVNULL)
        for entry in filter_mutants(db, tree, session, mine, excluded):
            print(f"[{name}] an equivalent entry matches no mutant: {entry}", flush=True)
    if run.report_only:
        filter_mutants(db, tree, session, mine, excluded)  # entries added since the run
        finished = True
    else:
        finished = run_exec(run.tool_bin, cfg, db, tree, env, stop_at, run.interrupted)
    result = score(db)
    counts = result["counts"]
    print(f"[{name}] {counts}", flush=True)
    lines = [f"## {name}: {', '.join(session['modules'])}", "", f"tests: {' '.join(session['tests'])}", "",
             f"ran {started:%H:%M}-{dt.datetime.now(dt.UTC):%H:%M} UTC" if not run.report_only else "report only", "",
             " | ".join(f"{k} {v}" for k, v in counts.items()), "", "### survivors", ""]
    lines += [f"```\n{s}\n```" for s in result["survivors"]] or ["none"]
    return finished, [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="the project's Python (its venv has the test dependencies)")
    parser.add_argument("--session", action="append", help="a session of tests/mutate.toml (default: all)")
    parser.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "graphserve-mutate"))
    parser.add_argument("--jobs", type=int, default=2, help="sessions run side by side, each in its own copy")
    parser.add_argument("--minutes", type=float, default=0,
                        help="time budget of the whole run (0: none): each session stops at the end of its slot")
    parser.add_argument("--stop-at", help="HH:MM UTC: interrupt then, leaving the rest pending")
    parser.add_argument("--resume", action="store_true", help="go on with the copies and sessions in WORKDIR")
    parser.add_argument("--report", action="store_true",
                        help="only the scores of the sessions in WORKDIR (after marking the config's equivalents)")
    args = parser.parse_args()

    config = tomllib.loads(CONFIG.read_text())
    sessions = args.session or list(config["session"])
    unknown = [s for s in sessions if s not in config["session"]]
    if unknown:
        raise SystemExit(f"unknown sessions {unknown}; tests/mutate.toml has {list(config['session'])}")
    workdir = Path(args.workdir).resolve()
    if workdir == REPO or workdir.is_relative_to(REPO):
        raise SystemExit("the work folder must be outside the repository: cosmic-ray edits files in place")
    now = dt.datetime.now(dt.UTC)
    stop_at = None
    if args.stop_at:
        hour, minute = map(int, args.stop_at.split(":"))
        stop_at = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
        if stop_at <= now:
            stop_at += dt.timedelta(days=1)
    jobs = max(1, min(args.jobs, len(sessions)))
    # equal slots: the sessions run in ceil(n / jobs) rounds of `jobs` side by side
    slot = dt.timedelta(minutes=args.minutes / math.ceil(len(sessions) / jobs)) if args.minutes > 0 else None
    end = min(filter(None, [stop_at, now + dt.timedelta(minutes=args.minutes) if slot else None]), default=None)
    run = Run(config, str(Path(args.python).absolute()), Path(sys.executable).parent, workdir,
              fresh=not (args.resume or args.report), report_only=args.report, interrupted=threading.Event())
    workdir.mkdir(parents=True, exist_ok=True)
    if slot:
        print(f"{len(sessions)} sessions, {jobs} at a time, {slot.total_seconds() / 60:.1f} min each", flush=True)

    def session_in_slot(name: str) -> tuple[bool, list[str]]:
        start = dt.datetime.now(dt.UTC)
        ends = [t for t in (end, start + slot if slot else None) if t is not None]
        return run_session(run, name, min(ends, default=None))

    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        results = list(pool.map(session_in_slot, sessions))
    except BaseException:
        run.interrupted.set()  # each session puts its module back and stops its tests
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    report = [f"# mutation testing, {now:%Y-%m-%d %H:%M} UTC", ""]
    for _, lines in results:
        report += lines
    (workdir / "report.md").write_text("\n".join(report))
    if not all(finished for finished, _ in results):
        print("stopped with mutants pending; `make mutate RESUME=1` goes on", flush=True)
    print(f"report: {workdir / 'report.md'}")


if __name__ == "__main__":
    main()
