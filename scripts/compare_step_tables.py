"""Builds' decode steps by kernel kind side by side, from `profile_decode.py --timeline --json`
files named PREFIX_BUILD_roundN.json (`device_run.sh builds` with STEP_ROUNDS writes them), or from
`bench_spec.py profile --json` ones (VERIFY_PROFILE_ROUNDS: a decode step's table and a verify round's):
    python3 scripts/compare_step_tables.py OUT/step_*.json OUT/verify_*.json
One table a PREFIX (a preset and batch; with a profile's table name after it), the --base build
(main) first, the others against it."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ninfer_core.bench_step import KindRow, compare  # noqa: E402

NAME = re.compile(r"^(?P<prefix>.+_b\d+)_(?P<build>.+)_round\d+\.json$")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--base", default="main", help="the build the others are set against")
    args = parser.parse_args()
    runs: dict[str, dict[str, list[list[KindRow]]]] = {}
    for path in sorted(args.files, key=lambda p: p.name):
        match = NAME.match(path.name)
        data = json.loads(path.read_text()) if match and path.is_file() else {}
        tables = {"": data["step_table"]} if data.get("step_table") else data.get("step_tables") or {}
        if not match or not all(tables.values()) or not tables:
            print(f"{path.name}: no step table (not PREFIX_BUILD_roundN.json from --timeline --json)", file=sys.stderr)
            continue
        for name, table in tables.items():
            run = f"{match['prefix']} {name}".strip()
            runs.setdefault(run, {}).setdefault(match["build"], []).append([KindRow(**r) for r in table])
    for prefix, builds in runs.items():
        ordered = dict(sorted(builds.items(), key=lambda item: (item[0] != args.base, item[0])))
        print(f"\n{prefix}:\n{compare(ordered)}")


if __name__ == "__main__":
    main()
