"""scripts/device_lib.sh, the part of scripts/device_run.sh that decides what a device call runs:
a builds entry's name and its GPU tests' pytest arguments, run in bash on hand-made queue files. A
mistake there costs device minutes (the forty-ninth session's combined build ran one part's tests)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parent.parent / "scripts" / "device_lib.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _bash(script: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f". {LIB}\n{script}"], cwd=cwd, capture_output=True, text=True, timeout=30)


def _test_args(entry: str, cwd: Path) -> list[str] | None:
    """queue_test_args' array for `entry` (None where it returns 1), one argument a line."""
    run = _bash(f'queue_test_args "{entry}" && printf "%s\\n" "${{test_args[@]}}"', cwd)
    assert not run.stderr, run.stderr
    return run.stdout.splitlines() if run.returncode == 0 else None


@pytest.fixture
def queue(tmp_path: Path) -> Path:
    q = tmp_path / "q"
    q.mkdir()
    (q / "a.tests").write_text("tests/test_a.py\ntests/test_x.py\n-k\nroute or graph\n")
    (q / "b.tests").write_text("tests/test_b.py\n-k\nfla and not slow\n")
    (q / "c.tests").write_text("tests/test_c.py\n")
    for name in ("a", "b", "c", "d"):  # d: a patch without a tests file
        (q / f"{name}.patch").write_text("")
    return tmp_path


def test_variant_names_an_entry_by_its_patches(queue):
    run = _bash('variant main; variant q/a.patch; variant "q/a.patch+q/b.patch"', queue)
    assert run.stdout.splitlines() == ["main", "a", "a+b"]


def test_a_patch_runs_its_own_list(queue):
    assert _test_args("q/a.patch", queue) == ["tests/test_a.py", "tests/test_x.py", "-k", "(route or graph)"]
    assert _test_args("q/c.patch", queue) == ["tests/test_c.py"]


def test_a_combined_entry_joins_its_parts_k_expressions(queue):
    assert _test_args("q/a.patch+q/b.patch", queue) == [
        "tests/test_a.py", "tests/test_x.py", "tests/test_b.py", "-k", "(route or graph) or (fla and not slow)"]


def test_a_part_without_k_runs_every_file_whole(queue):
    assert _test_args("q/a.patch+q/c.patch", queue) == ["tests/test_a.py", "tests/test_x.py", "tests/test_c.py"]


def test_parts_without_a_list_add_nothing(queue):
    assert _test_args("q/d.patch+q/b.patch", queue) == ["tests/test_b.py", "-k", "(fla and not slow)"]
    assert _test_args("q/d.patch", queue) is None

