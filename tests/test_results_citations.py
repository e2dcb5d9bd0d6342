"""Every results file the docs and code comments cite is in benchmarks/results/, with the key they name.

A citation is a path under `benchmarks/results/` (or `results/` in the docs), or, in Markdown, an
inline-code file name with a date in it. Patterns (`*`, `{a,b}`) must match at least one file. Not
checked: names behind a commit (`HASH:benchmarks/results/...`, kept in git), names with capitals
(placeholders such as NAME or SUFFIX), fenced code blocks (commands that write new files), the docs'
"Measured and removed" sections (which name files that left the tree) and the benchmark scripts
(whose paths say where a run writes). A citation followed by `, key `K`` (or `keys `A` and `B``)
must name top-level keys of that JSON file."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NAME = r"[\w.{},*-]+"
PATH_CITE = re.compile(rf"(?:(?P<hash>\b[0-9a-f]{{7,40}}):)?(?:\.\./)*(?:benchmarks/)?results/(?P<name>{NAME})")
BARE_CITE = re.compile(rf"`(?P<name>{NAME}\d{{4}}-\d\d-\d\d[\w.{{}},*-]*\.(?:json|png|log|csv))`")
KEYS_AFTER = re.compile(r"`?,?\s(?:key\s(?P<key>`[^`\s]+`)|keys\s(?P<keys>`[^`\s]+`(?:(?:,|\sand|,\sand)\s`[^`\s]+`)+))")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
REMOVED_SECTION = re.compile(r"^(#+) Measured and removed\n.*?(?=^\1 |\Z)", re.M | re.S)


def expand_braces(pattern: str) -> list[str]:
    """`a-{1,8}-{x,y}` -> the four names, innermost braces first."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    return [name for option in match.group(1).split(",")
            for name in expand_braces(pattern[: match.start()] + option + pattern[match.end():])]


def cited_files(name: str, present: list[str]) -> list[str]:
    return [found for pattern in expand_braces(name) for found in fnmatch.filter(present, pattern)]


def citations(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, name, keys named after it) of every results citation in the file."""
    text = path.read_text()
    patterns = [PATH_CITE]
    if path.suffix == ".md":  # blanked out line for line, so the line numbers stay
        for skipped in (FENCE, REMOVED_SECTION):
            text = skipped.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        patterns.append(BARE_CITE)
    found = []
    for pattern in patterns:
        for match in pattern.finditer(text):
            name = match.group("name").rstrip(".,")
            if match.groupdict().get("hash") or not name or re.search("[A-Z<]", name):
                continue
            after = KEYS_AFTER.match(text, match.end())
            keys = re.findall(r"`([^`]+)`", after.group("key") or after.group("keys")) if after else []
            found.append((text.count("\n", 0, match.start()) + 1, name, keys))
    return found


def citing_files() -> list[Path]:
    docs = [ROOT / "README.md", *sorted(ROOT.glob("docs/**/*.md")), *sorted(ROOT.glob("*/README.md"))]
    code = [p for folder in ("engine", "kernels", "server", "tests") for p in sorted((ROOT / folder).rglob("*.py"))]
    return [p for p in docs + code if p.is_file()]


def test_every_cited_result_is_in_the_tree_with_its_keys():
    present = sorted(p.name for p in RESULTS.iterdir())
    missing, bad_keys, count = [], [], 0
    for path in citing_files():
        for line, name, keys in citations(path):
            count += 1
            where = f"{path.relative_to(ROOT)}:{line}"
            files = cited_files(name, present)
            if not files:
                missing.append(f"{where}: {name}")
                continue
            for key_pattern in keys:
                for key in expand_braces(key_pattern):
                    if not any(f.endswith(".json") and key in json.loads((RESULTS / f).read_text()) for f in files):
                        bad_keys.append(f"{where}: {name} has no key {key!r}")
    assert count > 50, f"only {count} citations found: the patterns no longer see the docs' citations"
    assert not missing + bad_keys, ("cited results not in benchmarks/results/ (name the key of a merged file, "
                                    "or HASH:path for one that left the tree):\n" + "\n".join(missing + bad_keys))
