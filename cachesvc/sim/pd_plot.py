"""The P/D sweep's plot: per mode (each at its best prefill:decode ratio), goodput, TTFT p99 and
inter-token latency p99 against the load."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the sweep draws with this module: no import back at run time
    from cachesvc.sim.pd_sweep import PDRow

_PANELS = (
    ("goodput_rps", "goodput (requests/s within the SLO)"),
    ("ttft_p99_ms", "TTFT p99 (ms)"),
    ("itl_p99_ms", "inter-token latency p99 (ms)"),
)


def plot_rows(rows: Sequence[PDRow], path: str) -> None:
    """One line per mode over the loads of `rows` (a row per load and mode), into a PNG."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r.mode for r in rows))
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(4.4 * len(_PANELS), 3.4))
    for ax, (key, title) in zip(axes, _PANELS, strict=True):
        for mode in modes:
            mine = sorted((r for r in rows if r.mode == mode), key=lambda r: r.load)
            ax.plot(
                [r.load for r in mine],
                [getattr(r.result, key) for r in mine],
                marker="o",
                # Dynamic often lies on colocated (it keeps every request there): dashed, both show.
                linestyle="--" if mode == "dynamic" else "-",
                label=mode,
            )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("load (fraction of the colocated capacity)", fontsize=9)
        if key != "goodput_rps":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
