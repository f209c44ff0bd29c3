"""The simulator's pictures: per policy, per-tenant stacked running and waiting GPUs; JCT CDF; rho per tenant."""

from __future__ import annotations

import sys
from pathlib import Path

from dask_gpu.sim.simulator import Outcome

ESTIMATE_WORDS = {"user": "user (rounded up to modal limits, 20 % asked far too long)",
                  "oracle": "oracle (the real run times: a bound)", "none": "none (every job says the time limit)"}


def draw(outcomes: list[Outcome], path: Path, slice_name: str, facts: dict, command: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--plot needs matplotlib: .venv/bin/pip install -e '.[bench]'")
    tenants = sorted({t for o in outcomes for t in o.rho}, key=lambda t: -sum(o.jct_by_tenant.get(t, 0) for o in outcomes))
    colors = {t: plt.get_cmap("tab10" if len(tenants) <= 10 else "tab20")(i) for i, t in enumerate(tenants)}
    n = len(outcomes)
    fig = plt.figure(figsize=(15, 3.0 * n + 4.2))
    grid = fig.add_gridspec(n + 1, 2, height_ratios=[1.0] * n + [1.25], hspace=0.45, wspace=0.12)
    end = max(o.timeline[-1][0] for o in outcomes) / 3600
    top_wait = max(sum(w.values()) for o in outcomes for _, _, w in o.timeline) or 1
    for row, o in enumerate(outcomes):
        xs = [t / 3600 for t, _, _ in o.timeline]
        for col, which in enumerate(("running", "waiting")):
            ax = fig.add_subplot(grid[row, col])
            ys = [[(r if which == "running" else w).get(t, 0) for _, r, w in o.timeline] for t in tenants]
            ax.stackplot(xs, ys, colors=[colors[t] for t in tenants], step="post", linewidth=0)
            if which == "running":
                ax.axhline(o.capacity, color="black", linewidth=1, linestyle="--", label=f"capacity {o.capacity}")
                ax.set_ylim(0, o.capacity * 1.08)
                ax.legend(loc="upper right", fontsize=8)
            else:
                ax.set_ylim(0, top_wait * 1.05)
            ax.set_xlim(0, end)
            ax.set_title(f"{o.policy}: GPUs {which}" + (f"  (makespan {o.makespan / 3600:.1f} h, mean JCT "
                         f"{o.mean_jct / 3600:.2f} h, max rho {o.max_rho:.2f})" if which == "running" else ""), fontsize=10)
            if row == n - 1:
                ax.set_xlabel("hours since the first submit")
    cdf = fig.add_subplot(grid[n, 0])
    for o in outcomes:
        jct = sorted(o.jct)
        cdf.step([j / 3600 for j in jct], [(k + 1) / len(jct) for k in range(len(jct))], where="post", label=o.policy)
    cdf.set_xscale("log")
    cdf.set_xlabel("job completion time, hours (log)")
    cdf.set_ylabel("fraction of jobs")
    cdf.set_title("JCT CDF", fontsize=10)
    cdf.legend(fontsize=8)
    bars = fig.add_subplot(grid[n, 1])
    width = 0.8 / n
    for k, o in enumerate(outcomes):
        bars.bar([i + k * width for i in range(len(tenants))], [o.rho.get(t, 0) for t in tenants], width, label=o.policy)
    bars.axhline(1.25, color="red", linewidth=1, linestyle="--", label="target 1.25")
    bars.axhline(1.0, color="black", linewidth=0.8)
    bars.set_xticks([i + 0.4 - width / 2 for i in range(len(tenants))], [t[:6] for t in tenants], fontsize=8)
    bars.set_yscale("log")
    bars.set_ylabel("rho (log, Themis): JCT sum shared / alone")
    bars.set_title("finish-time fairness per tenant (label colours = tenant colours above)", fontsize=10)
    bars.legend(fontsize=8, ncol=2)
    for label, t in zip(bars.get_xticklabels(), tenants):
        label.set_color(colors[t])
    fig.suptitle(f"Philly trace {slice_name}: {facts['jobs']} jobs ({facts['gangs']} gangs), {facts['tenants']} "
                 f"tenants, offered load {facts['offered_load']:.2f}, {outcomes[0].capacity} GPUs, estimates: "
                 f"{ESTIMATE_WORDS.get(facts.get('estimates', 'oracle'), facts.get('estimates'))}\n{command}", fontsize=11)
    fig.savefig(path, dpi=72, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")

