"""What the three example flows share: the blocks an operator saves once, and the runner they run under.

An operator sets up the blocks once (in the Prefect UI, or with this module):

    .venv/bin/python -m flows.common          # saves the examples-* blocks that do not exist yet

Every example's `__main__` does the same before it runs, and never overwrites a block
that exists, so edits made in the Prefect UI (a revoked grant, a lower budget) stick.
A deployment must have the blocks before its first run: the runner loads them when the
flow run starts.

The runner reads its environment when the flow module is imported:

- `DASK_GPU_DECLARED`: the GPU inventory of the embedded Dask cluster; unset, the same
  default as `flows/nightly.py` (2 workers x 2 GPUs, 80 GB, H100); set to the empty
  string, the GPUs NVML finds on this host.
- `AISCHED_CONTROL_PLANE` / `AISCHED_TOKEN`: run under a shared control plane (`aisched serve`,
  its workers able to import `flows`) with the credential an operator issued; unset, each flow run
  starts an embedded control plane with its own local cluster and applies the example blocks itself.
- `AISCHED_HOME`: where an embedded control plane keeps its ledger (default `~/.aisched/ledger.db`).
- `AISCHED_EXAMPLES_APPROVER`: `pause` (a person answers the form in the Prefect UI, or
  `aisched approve`; a deployment run is suspended meanwhile and holds no process) or
  `policy` (nobody is asked; a rule that asks a person denies). Unset: `pause` when
  `PREFECT_API_URL` names a server a person can reach, else `policy` (a temporary
  server that nobody can answer would only wait out the rule's timeout).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from aisched_prefect import AISchedTaskRunner
from aisched_prefect.ledger import HOME_ENV
from blocks import (
    ApprovalPolicyBlock,
    ApprovalRule,
    AuthorityBlock,
    BudgetBlock,
    BudgetLimit,
    ClusterBlock,
    Grant,
    ModelLimit,
)
from dask_gpu import DECLARED_ENV
from flows.nightly import DECLARED

BLOCK_NAME = "examples-team"
"""Name of every example block (one per block type): authority, budget, approval policy, cluster."""

TENANT = "examples"
APPROVER = "alice"
"""The person who may approve promotions (and expensive runs) of the examples."""

APPROVER_ENV = "AISCHED_EXAMPLES_APPROVER"
PRINCIPALS = ("examples/nightly-training", "examples/batch-inference", "examples/llm-pipeline", "examples/deployments")
"""Who the example flows act as: each a member of the examples group, named exactly."""
LLM_MODEL = "example-llm"


def example_blocks() -> tuple[AuthorityBlock, BudgetBlock, ApprovalPolicyBlock, ClusterBlock]:
    """The blocks the examples run under, as an operator would write them. Pure data: nothing is saved."""
    authority = AuthorityBlock(grants=[
        # Every example flow acts as examples/<flow>, a member of the group; GPU type left open so NVML hosts work too.
        Grant(id="examples-root", principal=f"group:{TENANT}",
              kinds=["training", "evaluation", "promotion", "inference", "model-call"],
              max_gpus=4, max_cost_per_run=5.0),
        # A person, not a flow: the only one whose answer to an approval form counts.
        Grant(id="alice-approves", principal=APPROVER, kinds=["training", "evaluation", "promotion", "inference"],
              max_gpus=4, max_cost_per_run=5.0, can_approve=True),
    ], groups={TENANT: list(PRINCIPALS)})
    budget = BudgetBlock(
        limit=50.0, period="monthly", currency="USD",
        gpu_hour_prices={"H100": 4.0, "A100": 2.5, "*": 2.0},
        token_prices_per_1k={LLM_MODEL: 0.002, "*": 0.01},
        limits=[
            BudgetLimit(name="examples", scope="tenant", match=TENANT, amount=20.0),
            BudgetLimit(name="nightly-training", scope="flow", match="nightly-training", amount=10.0, parent="examples"),
            BudgetLimit(name="gpu-hours", unit="gpu-hours", scope="tenant", match=TENANT, amount=10.0,
                        period="weekly", window="rolling"),
            BudgetLimit(name="llm-tokens", unit="tokens", scope="model", match=f"{LLM_MODEL}*", amount=200_000,
                        period="daily"),
        ],
    )
    policy = ApprovalPolicyBlock(timeout_seconds=3600, rules=[
        # Kinds are free-form slugs, so "promotion" names exactly the step that needs a person.
        # Overnight: the nightly run's promotion may wait for the morning (suspended: no process, no hold).
        ApprovalRule(name="promotion-needs-a-person", kinds=["promotion"], timeout_seconds=12 * 3600),
        ApprovalRule(name="expensive-run", min_cost=2.0),
    ])
    cluster = ClusterBlock(model_limits=[
        # The fake provider allows 2 calls in flight and 120 starts a minute (one every 0.5 s).
        ModelLimit(model=f"{LLM_MODEL}*", concurrency=2, per_minute=120),
    ])
    return authority, budget, policy, cluster


def ensure_example_blocks(name: str = BLOCK_NAME) -> list[str]:
    """Save each example block that does not exist yet; return the slugs of those saved.

    Never overwrites: an operator's edits in the UI are what the examples must respect.
    """
    created = []
    for block in example_blocks():
        try:
            type(block).load(name)
        except ValueError:  # not there yet
            try:
                block.save(name, overwrite=False)
            except ValueError:  # saved by someone else meanwhile: theirs stands
                continue
            created.append(block.get_block_type_slug())
    return created


def example_runner(principal: str, approver: Any = None) -> AISchedTaskRunner:
    """The runner every example flow uses, configured from the environment (see the module docstring).

    Under a shared control plane the credential says who the flow is and which blocks it runs under, so
    the runner names nothing; embedded, it names the example blocks for its own control plane to apply.
    """
    chosen = approver if approver is not None else os.environ.get(
        APPROVER_ENV, "pause" if os.environ.get("PREFECT_API_URL") else "policy")
    if os.environ.get("AISCHED_CONTROL_PLANE"):
        return AISchedTaskRunner(approver=chosen)
    return AISchedTaskRunner(
        principal=principal, authority=BLOCK_NAME, budget=BLOCK_NAME, approval_policy=BLOCK_NAME, cluster=BLOCK_NAME,
        approver=chosen, declared=os.environ.get(DECLARED_ENV, DECLARED))


def examples_home() -> Path:
    """Where the examples keep their files (data, checkpoints, the model registry): $AISCHED_HOME/examples.

    Worker processes write here too, so on a multi-host cluster this must be shared
    storage; a real team would use object storage instead.
    """
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".aisched") / "examples"


if __name__ == "__main__":
    saved = ensure_example_blocks()
    print(f"saved {', '.join(saved)} as {BLOCK_NAME!r}" if saved else f"the {BLOCK_NAME!r} blocks already exist")


def flow_args(flow_obj: Any, argv: list[str] | None = None) -> dict[str, Any]:
    """The flow's parameters from the command line, one option per parameter of its function, named as it is with
    dashes: `python -m flows.batch_inference --shards 300 --gpu-fraction 0.5`; `--no-promote` for a bool that is
    true by default; a list takes several values. What is not given keeps the flow's default.

    >>> from prefect import flow
    >>> @flow
    ... def f(shards: int = 8, fraction: float = 0.25, promote: bool = True, names: list[str] | None = None): ...
    >>> flow_args(f, ["--shards", "300", "--no-promote", "--names", "a", "b"])
    {'shards': 300, 'promote': False, 'names': ['a', 'b']}
    """
    import argparse
    import inspect
    import typing

    fn = flow_obj.fn
    hints = typing.get_type_hints(fn)
    cli = argparse.ArgumentParser(prog=f"python -m {fn.__module__}", description=(fn.__doc__ or "").split("\n")[0],
                                  allow_abbrev=False)  # --shard is no --shards: a typo is refused, not guessed
    for name, param in inspect.signature(fn).parameters.items():
        kind = hints.get(name, str)
        args = typing.get_args(kind)
        base = next((a for a in args if a is not type(None)), kind) if args and type(None) in args else kind
        option = "--" + name.replace("_", "-")
        shown = f"(default: {param.default!r})"
        if base is bool:
            cli.add_argument(option, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                             help=shown)
        elif typing.get_origin(base) is list:
            item = (typing.get_args(base) or (str,))[0]
            cli.add_argument(option, dest=name, nargs="+", type=item, default=argparse.SUPPRESS, help=shown)
        else:
            cli.add_argument(option, dest=name, type=base if base in (int, float, str) else str,
                             default=argparse.SUPPRESS, help=shown)
    return vars(cli.parse_args(argv))
