"""Ray batch throughput: the batched job over 1 and 2 Ray workers, against the local job.

    PYTHONPATH=src .venv/bin/python scripts/ray_batch_throughput.py [--rounds 2]

16 prompts from the bench set (2 per category), 64 new tokens, greedy, ngram drafter, on the
default model. The configurations run interleaved, round after round, on one local Ray
instance; each one's clock starts after its workers have loaded the target. Prints one JSON
line per run and a summary (median tokens/s per configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from importlib.resources import files

os.environ.setdefault("RAY_worker_niceness", "0")  # Ray's default 15 loses to other work here
import ray
import torch

from speculative.batch_jobs import BatchJob, RowDecoder
from speculative.scaleout.ray_batch import ray_rows

CONFIGS = {  # name: (workers, CPUs per worker); None workers: the local job in this process
    "local, 1 thread": (None, 1),
    "ray, 1 worker x 1 CPU": (1, 1),
    "ray, 2 workers x 1 CPU": (2, 1),
    "local, 2 threads": (None, 2),
    "ray, 1 worker x 2 CPUs": (1, 2),
}


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return (
        f"{fields.get('Model name', '?').strip()} (family {fields.get('CPU family', '?').strip()})"
    )


def one_run(job: BatchJob, items: list, workers: int | None, cpus: int) -> tuple[int, float, list]:
    if workers is None:
        torch.set_num_threads(cpus)
        lines = RowDecoder(job).run(items)
        started = time.perf_counter()
        rows = list(lines)
    else:
        with ray_rows(job, items, workers, worker_cpus=cpus) as lines:
            started = time.perf_counter()
            rows = list(lines)
    seconds = time.perf_counter() - started
    rows.sort(key=lambda row: row["index"])
    return sum(len(r["token_ids"]) for r in rows), seconds, [r["token_ids"] for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--configs", nargs="+", default=list(CONFIGS)[:3], choices=list(CONFIGS), metavar="NAME"
    )
    args = parser.parse_args()
    text = files("speculative.bench").joinpath("data/prompts.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines()][::5]  # 16: 2 per category
    for record in records:
        record.pop("category")
    items = list(enumerate(records))
    job = BatchJob(draft="ngram", gamma=4, max_new_tokens=args.max_new_tokens, batch_size=8)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(
        json.dumps(
            {
                "cpu": cpu_name(),
                "cores": torch.get_num_threads(),
                "python": platform.python_version(),
            }
        )
    )
    rates: dict[str, list[float]] = {name: [] for name in args.configs}
    reference = None
    for round_ in range(args.rounds):
        for name in args.configs:
            workers, cpus = CONFIGS[name]
            tokens, seconds, outputs = one_run(job, items, workers, cpus)
            reference = reference or outputs
            rates[name].append(tokens / seconds)
            print(
                json.dumps(
                    {
                        "round": round_,
                        "config": name,
                        "tokens": tokens,
                        "seconds": round(seconds, 2),
                        "tokens_per_second": round(tokens / seconds, 1),
                        "same_tokens_as_first_run": outputs == reference,
                    }
                ),
                flush=True,
            )
    ray.shutdown()
    base = statistics.median(next(iter(rates.values())))
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:26s} median {median:6.1f} tok/s  ({median / base:.2f}x the first)")


if __name__ == "__main__":
    main()
