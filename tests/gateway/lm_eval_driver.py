"""Run lm-evaluation-harness on the shipped tasks through its Python API; run by the lm-eval venv.

Usage: ``python lm_eval_driver.py MODEL_ARGS OUTPUT_PATH TASKS INCLUDE_PATH``. The same evaluation
as ``lm-eval run --model local-completions --model_args MODEL_ARGS --batch_size 4 --tasks TASKS
--include_path INCLUDE_PATH --output_path OUTPUT_PATH --log_samples`` (the same model class,
requests and result files, written by lm-eval's own ``EvaluationTracker``), without the one thing
the CLI adds here: its ``TaskManager`` always indexes lm-eval's ~14,000 built-in task files
before it looks at ``--include_path`` (18 s of CPU a run on a 2-core Zen 3, more than the
evaluation itself); ``TaskManager(include_defaults=False)`` reads INCLUDE_PATH only.
"""

from __future__ import annotations

import sys

from lm_eval import simple_evaluate
from lm_eval.loggers import EvaluationTracker
from lm_eval.tasks import TaskManager


def main(model_args: str, output_path: str, tasks: str, include_path: str) -> None:
    tracker = EvaluationTracker(output_path=output_path)
    results = simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=tasks.split(","),
        batch_size=4,
        log_samples=True,
        evaluation_tracker=tracker,
        task_manager=TaskManager(include_path=include_path, include_defaults=False),
    )
    if results is None:
        raise SystemExit("lm-eval returned no results")
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for task_name in results["configs"]:
        tracker.save_results_samples(task_name=task_name, samples=samples[task_name])


if __name__ == "__main__":
    main(*sys.argv[1:])
