"""A stand-in trainer: the process `flows/training.py` launches on the GPUs its task was given.

A real team runs `torchrun --nproc-per-node=<GPUs> train.py ...` (or deepspeed) here;
this one only does what matters to the example: it reads the data, "trains" for a few
epochs with deterministic arithmetic (no framework), and writes a checkpoint that
records which devices the process could see (`CUDA_VISIBLE_DEVICES`, set by the worker).

    python flows/scripts/train_step.py --data data.jsonl --epochs 2 --out checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def train(rows: list[dict[str, float]], epochs: int) -> tuple[float, list[float]]:
    """Fit y = w * x by gradient descent: a weight and a loss per epoch, the same every run."""
    w, losses = 0.0, []
    for _ in range(epochs):
        for row in rows:
            w -= 0.05 * (w * row["x"] - row["y"]) * row["x"]
        losses.append(sum((w * r["x"] - r["y"]) ** 2 for r in rows) / len(rows))
        time.sleep(0.2)  # an epoch takes a while, even here
    return w, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--data", required=True, type=Path)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()

    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    weight, losses = train(rows, args.epochs)
    checkpoint = {
        "weight": weight, "epochs": args.epochs, "rows": len(rows), "loss": losses,
        "cuda_visible_devices": visible, "world_size": len([d for d in visible.split(",") if d]),
        "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"), "pid": os.getpid(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(checkpoint, indent=2))
    tmp.replace(args.out)  # readers never see half a checkpoint
    print(json.dumps({"checkpoint": str(args.out), "loss": losses[-1] if losses else None, "devices": visible}))


if __name__ == "__main__":
    main()
