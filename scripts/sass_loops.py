"""Instruction counts of a kernel's loops, from the SASS `scripts/device_run.sh sass` brings back.

A kernel bound by instruction issue (ncu: issue near its peak, a few instructions a weight) gets
faster only by dropping instructions from its inner loop; this prints, for each backward branch
of the chosen kernel (a loop: from its target label to the branch), how many instructions the
loop holds and which opcodes they are, so that a change can be judged by its SASS before the GPU
times it. No parser library reads cuobjdump's text, hence these few regular expressions.

    python3 scripts/sass_loops.py sass.txt.gz 'quant_gemv_kernel.*CodesE2ELi1ELNS0_6LayoutE1ELb0'

With --wait it prints instead the global loads on either side of each programmatic-dependent-launch
wait (`griddepcontrol.wait`, SASS ACQBULK), by mnemonic: ptxas places the wait as early as its
basic block allows, so loads a kernel means to issue before the wait (weights, constants) may sit
after it in the SASS (docs/performance.md, eighteenth session), and read-only (.CONSTANT) loads of
the previous kernel's outputs must not sit before it.
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter
from pathlib import Path

FUNCTION = re.compile(r"^\s*Function : (\S+)")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
# a branch names its target by label (`(.L_x_12)`) or, in newer cuobjdump, by address (`0xb00`)
BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)|(0x[0-9a-f]+)\s*$")


def functions(text: str) -> dict[str, list[str]]:
    """Each function's lines, by its (mangled) name."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        match = FUNCTION.match(line)
        if match:
            current = out.setdefault(match.group(1), [])
        elif current is not None:
            current.append(line)
    return out


def opcode(instruction: str) -> str:
    """The opcode without its predicate and modifiers: `@!P0 LDG.E.128.CONSTANT` -> LDG."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def loops(lines: list[str]) -> list[tuple[str, int, int, Counter[str]]]:
    """(target, first index, last index, opcode counts) of every backward branch."""
    program: list[str] = []
    labels: dict[str, int] = {}
    for line in lines:
        label = LABEL.match(line)
        if label:
            labels[label.group(1)] = len(program)
            continue
        instruction = INSTRUCTION.match(line)
        if instruction:
            labels[f"0x{int(instruction.group(1), 16):x}"] = len(program)
            program.append(instruction.group(2))
    found = []
    for i, instruction in enumerate(program):
        match = BRANCH_TARGET.search(instruction)
        target = match and (match.group(1) or match.group(2))
        if opcode(instruction) == "BRA" and target and labels.get(target, i) < i:  # not the trailing `BRA .` idle loop
            start = labels[target]
            found.append((target, start, i, Counter(opcode(x) for x in program[start : i + 1])))
    return found


def loads_around_waits(lines: list[str]) -> list[tuple[int, Counter[str], Counter[str]]]:
    """(index, loads since the previous wait or the start, loads after it up to the next) of each
    PDL wait, loads counted by mnemonic without predicate (`LDG.E.NA.128.CONSTANT`)."""
    program = [m.group(2) for m in map(INSTRUCTION.match, lines) if m]
    waits = [i for i, x in enumerate(program) if opcode(x) == "ACQBULK"]

    def loads(start: int, stop: int) -> Counter[str]:
        return Counter(x.split()[1 if x.startswith("@") else 0] for x in program[start:stop] if opcode(x) == "LDG")

    bounds = [0, *waits, len(program)]
    return [(w, loads(bounds[k], w), loads(w + 1, bounds[k + 2])) for k, w in enumerate(waits)]


def listed(counts: Counter[str]) -> str:
    return ", ".join(f"{op} {n}" for op, n in sorted(counts.items())) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sass", type=Path, help="cuobjdump -sass output (.gz or text)")
    parser.add_argument("kernel", help="regular expression over the mangled function names")
    parser.add_argument("--top", type=int, default=14, help="opcodes shown per loop")
    parser.add_argument("--wait", action="store_true", help="the loads on either side of each PDL wait instead")
    args = parser.parse_args()
    raw = args.sass.read_bytes()
    text = (gzip.decompress(raw) if args.sass.suffix == ".gz" else raw).decode(errors="replace")
    matched = {name: lines for name, lines in functions(text).items() if re.search(args.kernel, name)}
    if not matched:
        raise SystemExit(f"no function matches {args.kernel!r}")
    for name, lines in matched.items():
        print(name)
        if args.wait:
            for index, before, after in loads_around_waits(lines):
                print(f"  wait at instruction {index}: before {listed(before)}; after {listed(after)}")
            continue
        for label, start, end, counts in loops(lines):
            ops = ", ".join(f"{op} {n}" for op, n in counts.most_common(args.top))
            print(f"  loop {label}: {end - start + 1} instructions, HMMA {counts['HMMA']}: {ops}")


if __name__ == "__main__":
    main()
