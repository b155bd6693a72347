"""Whether the int4 layers are bound by their weight stream or by their arithmetic, per k.

    PYTHONPATH=src .venv/bin/python scripts/int4_stream_vs_hot.py --isa avx2 --k 1 2 4 5 8

Builds a small C harness around this tree's kernels.c (the runtime's compiler flags for
--isa) that lays out the default model's int4 matrices (SmolLM2-135M's shapes, 30 layers
of qkv, o, gate_up and down) as random Q4_1 blocks on huge pages, then times k-row passes
in one parallel region, as the forward runs them:

  streamed  every matrix once, in order (76 MB: the weights come from memory)
  hot       every matrix three times in a row (the second and third read it from cache)

Equal times mean the weight stream is hidden and the tiles' arithmetic binds; streamed
above hot by the k = 1 gap means it is not. Prints the median ms per pass of --repeats
rounds (all k interleaved in each round) and the time per extra token. HARNESS_FLAGS adds
compiler flags, e.g. HARNESS_FLAGS=-DQ4_PANEL16_ROWS=1 to time kernels.c's other tile
switch (runs in separate processes drift with the machine: compare several of each).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from speculative.hardware import cpu_info
from speculative.models.native import ckernels

EXTRA = os.environ.get("HARNESS_FLAGS", "").split()  # more compiler flags for the harness
HARNESS = r"""
#include KERNELS
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* argv: layers hidden qkv intermediate threads repeats k... */
int main(int argc, char **argv) {
    const int layers = atoi(argv[1]), hidden = atoi(argv[2]), qkv = atoi(argv[3]);
    const int inter = atoi(argv[4]), threads = atoi(argv[5]), repeats = atoi(argv[6]);
    const int shapes[4][2] = {
        {qkv, hidden}, {hidden, hidden}, {2 * inter, hidden}, {hidden, inter}};
    const int n = 4 * layers, widest = inter > hidden ? inter : hidden;
    size_t total = 0;
    for (int l = 0; l < n; l++)
        total += (size_t)(shapes[l % 4][0] / 8) * (shapes[l % 4][1] / 32) * Q4_BLOCK_BYTES;
    const size_t huge = (size_t)2 << 20, bytes = (total + huge) / huge * huge;
    uint8_t *arena = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    madvise(arena, bytes, MADV_HUGEPAGE);
    for (size_t b = 0; b < total; b++) arena[b] = (uint8_t)(b * 2654435761u >> 13);
    Linear *L = calloc((size_t)(n > 0 ? n : 1), sizeof(Linear));
    for (int l = 0, at = 0; l < n; l++) {
        const int out = shapes[l % 4][0], in = shapes[l % 4][1];
        const size_t blocks = (size_t)(out / 8) * (in / 32);
        L[l].format = FMT_Q4, L[l].in_features = in, L[l].out_features = out;
        L[l].weight = arena + (size_t)at;
        for (size_t b = 0; b < blocks; b++) {  /* small fp16 scales d and m */
            uint16_t *h = (uint16_t *)(arena + (size_t)at + b * Q4_BLOCK_BYTES + 128);
            for (int j = 0; j < 16; j++) h[j] = (uint16_t)(0x2000 + j);
        }
        at += (int)(blocks * Q4_BLOCK_BYTES);
    }
    int most = 1;
    for (int a = 7; a < argc; a++) most = atoi(argv[a]) > most ? atoi(argv[a]) : most;
    const size_t floats = (size_t)most * 2 * inter;
    float *x = malloc(sizeof(float) * floats), *y = malloc(sizeof(float) * floats);
    for (size_t j = 0; j < floats; j++) x[j] = (float)((j * 7) % 13) - 6.0f;
    const int groups = QUANT_ARRAYS * padded_groups(widest);
    float *work = aligned_alloc(64, sizeof(float) * ((size_t)most * (widest / 4 + groups) + 64));
    for (int r = 0; r < repeats + 1; r++)
        for (int a = 7; a < argc; a++) {
            const int k = atoi(argv[a]);
            QuantRows qx = quant_rows_at(work, k, widest);
            const double t0 = now();
#pragma omp parallel num_threads(threads)
            for (int l = 0; l < n; l++) linear(&L[l], x, k, y, L[l].out_features, 0, &qx);
            const double t1 = now();
#pragma omp parallel num_threads(threads)
            for (int l = 0; l < n; l++)
                for (int again = 0; again < 3; again++)
                    linear(&L[l], x, k, y, L[l].out_features, 0, &qx);
            const double t2 = now();
            if (r) printf("%d %.6f %.6f\n", k, (t1 - t0) * 1e3, (t2 - t1) * 1e3 / 3);
        }
    return 0;
}
"""


def build(isa: str, folder: Path) -> Path:
    """The harness compiled with the runtime's flags for ``isa``, around kernels.c."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc/gcc) found")
    source, binary = folder / "harness.c", folder / "harness"
    source.write_text(HARNESS)
    flags = [f for f in ckernels.COMMON_FLAGS if f not in ("-shared", "-fPIC")]
    flags += [*ckernels.ISA_FLAGS[isa], f'-DKERNELS="{ckernels.SOURCE}"', *EXTRA]
    subprocess.run([compiler, *flags, str(source), "-o", str(binary), "-lm"], check=True)
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", choices=sorted(ckernels.ISA_FLAGS), default="avx2")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 5, 8])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--qkv", type=int, default=960, help="q + k + v output rows")
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        binary = build(args.isa, Path(folder))
        shape = [args.layers, args.hidden, args.qkv, args.intermediate, args.threads]
        command = [str(binary), *map(str, shape), str(args.repeats), *map(str, args.k)]
        lines = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    times: dict[int, dict[str, list[float]]] = {}
    for row in lines.strip().splitlines():
        k, streamed, hot = row.split()
        entry = times.setdefault(int(k), {"streamed": [], "hot": []})
        entry["streamed"].append(float(streamed))
        entry["hot"].append(float(hot))
    print(f"cpu: {cpu_info().summary()} · kernels {args.isa} · {args.threads} threads")
    median = {k: {w: statistics.median(v) for w, v in t.items()} for k, t in times.items()}
    first = min(median)
    for k in sorted(median):
        streamed, hot = median[k]["streamed"], median[k]["hot"]
        extra = (hot - median[first]["hot"]) / (k - first) if k > first else float("nan")
        print(f"k {k:3d}  streamed {streamed:7.3f} ms  hot {hot:7.3f} ms  "
              f"streamed/hot {streamed / hot:5.2f}  hot ms/extra token {extra:6.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
