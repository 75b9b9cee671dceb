"""Plot `ninfer bench --json` reports: aggregate decode tok/s by batch and prefill tok/s by length.
    python3 scripts/plot_bench.py OUT.png REPORT.json [REPORT.json ...]   (needs matplotlib)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    out, reports = Path(sys.argv[1]), [json.loads(Path(p).read_text()) for p in sys.argv[2:]]
    fig, (dec, pre) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in reports:
        label = f"{r['model']} {r['weights']}{'' if r['cuda_graphs'] else ' eager'}"
        runs = sorted((d for d in r["decode"] if d["context"] == 4096), key=lambda d: d["batch"])
        if runs:
            dec.plot([d["batch"] for d in runs], [d["tok_s"] for d in runs], marker="o", label=label)
        if r["prefill"]:
            pre.plot([p["tokens"] for p in r["prefill"]], [p["tok_s"] for p in r["prefill"]], marker="o", label=label)
    dec.set(title="decode at 4K context (aggregate)", xlabel="batch", ylabel="tok/s", xscale="log", yscale="log")
    pre.set(title="prefill", xlabel="prompt tokens", ylabel="tok/s", xscale="log")
    for ax in (dec, pre):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"ninfer on {reports[0]['device']}, {reports[0]['date']} (random weights, exact shapes)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
