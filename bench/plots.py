"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

GiB = 1024**3


def _size_axis(ax: Any) -> None:
    """A log x axis of GiB labelled like sizes (500 GiB, 2 TiB), not powers of ten; call
    after plotting (the tick density follows the data's range)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    low, high = ax.get_xlim()
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if high / low < 50
                                          else (1.0,)))
    ax.xaxis.set_major_formatter(FuncFormatter(
        lambda x, _: f"{x / 1024:.3g} TiB" if x >= 1024 else f"{x:.0f} GiB"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("cache capacity (real KV size)")


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def hit_rate_curve(runs: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Block hit rate against capacity (real size), one line per policy; the unlimited
    run is the dashed ceiling."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    policies = sorted({r["policy"] for r in runs if r["capacity_chunks"]})
    for name in policies:
        pts = sorted((r["capacity_bytes"] / GiB, 100 * r["block_hit_rate"])
                     for r in runs if r["policy"] == name and r["capacity_chunks"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    for r in runs:
        if not r["capacity_chunks"]:
            ax.axhline(100 * r["block_hit_rate"], linestyle="--", color="grey",
                       label=f"unlimited ({100 * r['block_hit_rate']:.1f}%)")
    _size_axis(ax)
    ax.set_ylabel("block hit rate (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    _save(fig, path)


def plan_chart(rows: Sequence[dict[str, Any]], path: Path, title: str,
               break_even_gbps: float, bandwidth_gbps: float) -> None:
    """Left: hit rate against capacity per policy. Right: mean TTFT saved per request
    against capacity at the planned bandwidth."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in sorted({r["policy"] for r in rows}):
        pts = sorted((r["capacity_bytes"] / GiB, 100 * r["token_hit_rate"],
                      r["ttft_saved_ms_per_request"]) for r in rows if r["policy"] == name)
        xs = [p[0] for p in pts]
        left.plot(xs, [p[1] for p in pts], marker="o", label=name)
        right.plot(xs, [p[2] for p in pts], marker="o", label=name)
    left.set_ylabel("token hit rate (%)")
    right.set_ylabel(f"mean TTFT saved per request (ms) at {bandwidth_gbps:g} GB/s")
    right.axhline(0, color="black", linewidth=0.8)
    for ax in (left, right):
        _size_axis(ax)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{title}\nbreak-even load bandwidth {break_even_gbps:.3g} GB/s "
                 "(below it, recompute wins)", fontsize=9)
    _save(fig, path)


def ttft_bars(results: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """TTFT p50 and p90, cold (no cache) against warm (cache), one group per workload/store."""
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(results)), 4.2))
    labels = [f"{r['workload']}\n{r['store'].split('://')[0]}" for r in results]
    series = [("cold p50", "cold_p50_s", "#1f77b4"), ("cold p90", "cold_p90_s", "#aec7e8"),
              ("warm p50", "warm_p50_s", "#ff7f0e"), ("warm p90", "warm_p90_s", "#ffbb78")]
    width = 0.8 / len(series)
    for i, (name, field, color) in enumerate(series):
        xs = [j + (i - 1.5) * width for j in range(len(results))]
        ax.bar(xs, [1000 * r[field] for r in results], width, label=name, color=color)
    ax.set_xticks(range(len(results)), labels, fontsize=8)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)  # room for the legend above the bars
    ax.legend(ncol=4, loc="upper center", fontsize=8)
    _save(fig, path)
