"""An LLM pipeline: model calls under a token budget and the model's rate limits, each reporting what it used.

What it shows:

- `answer` and `summarize` are `@ai_task(kind="model-call", model=..., est_tokens=...)`
  tasks: no GPU, but each call is admitted (the grant must allow the model), holds
  `est_tokens` on the budget's daily token limit for the model (and their price in
  USD), and reports its real usage with `report_usage(input_tokens=..., output_tokens=...)`;
  settlement charges what was reported and releases the rest of the hold.
- The example ClusterBlock limits `example-llm*` to 2 calls in flight and 120 starts a
  minute, shared by every flow run on the cluster: the mapped calls wait for a slot
  (kept by the cluster's scheduler, beside its queue) instead of hitting the provider's 429s, and
  each settlement records how long its call waited (`model_limit.waited`).
- `tally` (a plain task) adds up the usage the calls reported.

Run it locally (no network, no GPU: the "LLM" is deterministic arithmetic):

    .venv/bin/python -m flows.llm_pipeline

A real team replaces `fake_completion` with their provider's SDK call and reports the
usage the provider returns (`reply.usage.prompt_tokens`, ...), optionally with `cost=`,
the provider's own charge. Environment settings: see `flows/common.py`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

from prefect import Task, flow, get_run_logger, task, unmapped
from prefect.context import FlowRunContext

from aisched_prefect import ai_task, report_usage, task_logger
from flows.common import LLM_MODEL, ensure_example_blocks, example_runner

PRINCIPAL = "examples/llm-pipeline"
DEFAULT_PROMPTS = (
    "Summarise last night's training run in one sentence.",
    "List three risks of promoting a model without evaluation.",
    "Explain fractional GPUs to a new engineer.",
    "Write a haiku about budget holds.",
    "What does a hash-chained evidence log protect against?",
    "Suggest a name for an internal model registry.",
)
VOCABULARY = ("model", "budget", "GPU", "token", "evidence", "approval", "shard", "worker", "ledger", "grant",
              "train", "serve", "limit", "rate", "checkpoint", "flow")


def fake_completion(model: str, prompt: str, max_output_tokens: int) -> dict[str, Any]:
    """A deterministic stand-in for a provider call: the same prompt always gets the same reply and usage."""
    seed = hashlib.sha256(f"{model}\n{prompt}".encode()).digest()
    n = min(max_output_tokens, 8 + seed[0] % 24)
    words = [VOCABULARY[b % len(VOCABULARY)] for b in (seed * 2)[:n]]
    time.sleep(0.2)  # network and generation latency
    return {"text": " ".join(words), "input_tokens": len(prompt.split()), "output_tokens": n}


def call_model(prompt: str, model: str, max_output_tokens: int) -> dict[str, Any]:
    """One model call, reporting the tokens it used so the budget is charged for them."""
    reply = fake_completion(model, prompt, max_output_tokens)
    report_usage(input_tokens=reply["input_tokens"], output_tokens=reply["output_tokens"])
    task_logger().info("%s: %d tokens in, %d out", model, reply["input_tokens"], reply["output_tokens"])
    return {"prompt": prompt, **reply}


def model_call(model: str, est_tokens: int, name: str) -> Task[..., dict[str, Any]]:
    """A model-call task for `model`; admission holds `est_tokens`, settlement charges what it reports."""
    return ai_task(kind="model-call", model=model, est_tokens=est_tokens, name=name)(call_model)


@task
def summary_prompt(answers: list[dict[str, Any]]) -> str:
    """The prompt of the final call: every answer, numbered."""
    return "Summarise these answers:\n" + "\n".join(f"{i + 1}. {a['text']}" for i, a in enumerate(answers))


@task
def tally(answers: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    """Total the usage every call reported; this is what the budget was charged."""
    calls = [*answers, summary]
    usage = {"calls": len(calls), "input_tokens": sum(c["input_tokens"] for c in calls),
             "output_tokens": sum(c["output_tokens"] for c in calls)}
    usage["tokens"] = usage["input_tokens"] + usage["output_tokens"]
    return {"answers": answers, "summary": summary, "usage": usage}


@flow(name="llm-pipeline", task_runner=example_runner(PRINCIPAL), log_prints=True)
def llm_pipeline(prompts: list[str] | None = None, model: str = LLM_MODEL, max_output_tokens: int = 64,
                 est_tokens_per_call: int = 400) -> dict[str, Any]:
    """Answer every prompt (mapped, rate-limited), summarise the answers in one more call, total the usage."""
    log = get_run_logger()
    prompts = list(DEFAULT_PROMPTS) if prompts is None else prompts
    answers = model_call(model, est_tokens_per_call, "answer").map(
        prompts, model=unmapped(model), max_output_tokens=unmapped(max_output_tokens))
    final = model_call(model, est_tokens_per_call * 2, "summarize")(summary_prompt(answers), model, max_output_tokens)
    result = tally(answers, final)
    log.info("%d calls to %s used %d tokens", result["usage"]["calls"], model, result["usage"]["tokens"])
    return {**result, "flow_run_id": str(FlowRunContext.get().flow_run.id)}


if __name__ == "__main__":
    from flows.common import flow_args
    from flows.nightly import print_evidence

    parameters = flow_args(llm_pipeline)  # e.g. --prompts "a question" "another" (--help lists them)
    logging.getLogger("distributed").setLevel(logging.WARNING)  # keep the output about the example
    ensure_example_blocks()
    state = llm_pipeline(**parameters, return_state=True)
    print(json.dumps({"summary": state.result()["summary"]["text"], "usage": state.result()["usage"]}, indent=2))
    print_evidence(str(state.state_details.flow_run_id))
