"""Throughput against the optimum over time, as a PNG: the picture behind the averages.

matplotlib is imported here only, with the file-only Agg backend, so the simulator itself needs
nothing beyond the standard library.
"""

from __future__ import annotations

from pathlib import Path

from swarmd.sim.engine import SimResult


def plot_timelines(panels: dict[str, dict[str, SimResult]], path: Path) -> Path:
    """One panel per title, each showing the optimum and every rule's throughput over hours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False)
    for ax, (title, results) in zip(axes[:, 0], panels.items()):
        first = next(iter(results.values()))
        hours = [t / 3600.0 for t, _, _ in first.timeline]
        ax.plot(hours, [opt for _, _, opt in first.timeline], color="black", lw=1.4, label="optimal")
        for name, result in results.items():
            ax.plot(hours, [thr for _, thr, _ in result.timeline], lw=0.8, label=f"{name} ({result.ratio:.3f})")
        ax.set_title(title)
        ax.set_xlabel("hours")
        ax.set_ylabel("pipeline samples/s")
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
