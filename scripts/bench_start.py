"""Second start of a quantized model: how long loading the on-disk artifact takes in a new process.

Builds the synthetic model in the recipe (random weights), writes its artifact exactly as the
loader does after a first start (`weights/quant_cache.py`), evicts the file from the page cache
(fsync + POSIX_FADV_DONTNEED: a cold read, as after a reboot), then times a fresh Python process
doing what `load_model` does on a second start: build on meta, materialise, load the artifact.
    python3 scripts/bench_start.py qwen3.6-35b-a3b DIR [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ninfer_core.models.loader import random_model  # noqa: E402
from ninfer_core.models.presets import preset  # noqa: E402
from ninfer_core.models.quantize import QuantRecipe  # noqa: E402
from ninfer_core.weights import quant_cache  # noqa: E402

CHILD = """
import sys, time
t0 = time.perf_counter()
import torch
from ninfer_core.models.loader import build_model
from ninfer_core.models.presets import preset
from ninfer_core.models.quantize import QuantRecipe
from ninfer_core.weights import quant_cache
t1 = time.perf_counter()
model = build_model(preset(sys.argv[1]), torch.device("cuda"), torch.bfloat16, QuantRecipe(sys.argv[2]))
assert quant_cache.load(model, __import__("pathlib").Path(sys.argv[3]))
torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f}")
"""


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--weights", default="int4")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / f"{args.preset}-{args.weights}.safetensors"
    model = random_model(preset(args.preset), torch.device("cuda"), torch.bfloat16, QuantRecipe(args.weights))
    t = time.perf_counter()
    quant_cache.save(model, path)
    save_s = time.perf_counter() - t
    del model
    torch.cuda.empty_cache()
    results = {}
    for cache in ("cold", "warm"):
        if cache == "cold":
            evict(path)
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, args.preset, args.weights, str(path)], check=True,
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        total = time.perf_counter() - t
        imports, load = map(float, out.stdout.split())
        results[cache] = dict(process_s=total, imports_s=imports, load_s=load)
        print(f"{cache} page cache: new process {total:.1f} s (imports {imports:.1f} s, build + load {load:.1f} s)")
    report = dict(preset=args.preset, weights=args.weights, artifact_bytes=path.stat().st_size, save_s=save_s, **results)
    print(f"artifact {path.stat().st_size / 1e9:.1f} GB, written in {save_s:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    path.unlink()


if __name__ == "__main__":
    main()
