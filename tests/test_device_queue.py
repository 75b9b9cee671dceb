"""The changes waiting for the GPU (scripts/device_queue/): each patch applies to this checkout, and
each names GPU tests that exist (here or in the patch), so that the device call that measures them
loses none to a stale patch or a missing test file (device_run.sh's `builds` leaves such a patch out)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUEUE = ROOT / "scripts" / "device_queue"
PATCHES = sorted(QUEUE.glob("*.patch"))


def _in_git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    probe = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT, capture_output=True, text=True)
    return probe.returncode == 0 and probe.stdout.strip() == "true"


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.stem)
def test_queued_patch_applies_to_this_checkout(patch: Path):
    if not _in_git_checkout():
        pytest.skip("not a git checkout")
    check = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    if check.returncode != 0:
        def applied(*where: str) -> bool:
            command = ["git", "apply", "--check", "--reverse", *where, str(patch)]
            return subprocess.run(command, cwd=ROOT, capture_output=True).returncode == 0

        assert not applied("--cached"), f"{patch.name} is in the index (landed?): take it out of the queue"
        if applied():
            pytest.skip(f"{patch.name} is applied in this working tree only")
    assert check.returncode == 0, f"{patch.name} no longer applies (re-make it against main):\n{check.stderr}"


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.stem)
def test_queued_patch_names_existing_gpu_tests(patch: Path):
    tests = patch.with_suffix(".tests")
    assert tests.is_file(), f"{patch.name} has no {tests.name}"
    lines = tests.read_text().splitlines()
    files = [line for line in lines if line.startswith("tests/")]
    assert files, f"{tests.name} names no test file"
    # one argument a line; `-k` at most once, its expression on the next line (device_lib.sh)
    assert lines.count("-k") <= 1 and ("-k" not in lines or lines.index("-k") < len(lines) - 1), tests.name
    created = {line.removeprefix("+++ b/") for line in patch.read_text().splitlines() if line.startswith("+++ b/")}
    missing = [f for f in files if not (ROOT / f.split("::")[0]).is_file() and f.split("::")[0] not in created]
    assert not missing, f"{tests.name} names files neither here nor in the patch: {missing}"


def test_queue_readme_lists_every_patch():
    readme = (QUEUE / "README.md").read_text()
    unlisted = [p.stem for p in PATCHES if f"`{p.stem}`" not in readme]
    assert not unlisted, f"scripts/device_queue/README.md does not describe {unlisted}"
