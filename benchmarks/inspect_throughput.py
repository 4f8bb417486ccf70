"""How fast `deadweight inspect` reads a large safetensors file, next to the raw limit and a naive peer.

Two page-cached files of at least 2 GB (fp32 and bf16; 128 MB tensors plus small
ones) are written to a temporary directory. Each variant runs in its own process,
the variants take turns round after round, and each reports its wall time and peak
resident memory (VmHWM):

* raw:   the fastest plain read-and-reduce of the same bytes: one np.memmap over the
         data section (header parsed here) and one max() per tensor;
* raw-2t: the same split over two threads (numpy releases the GIL), for a machine
         with two cores: the limit for a reader that uses both, as inspect does;
* inspect: `deadweight.inspect_checkpoints([file], scheme=None)`: full per-tensor
         statistics (min, max, mean, std, zeros, NaN/Inf) in bounded memory;
* inspect+int4: the default `inspect`, with the quantization analysis (int4 per
         group of 128), here also for every layer scalar quantized with its layer's
         weight;
* inspect+channel, inspect+tensor: `inspect` with a scheme the kernels do not measure
         (int8 per channel, int4 per tensor), streamed in bounded chunks by numpy;
* inspect-fallback: `inspect` without the native kernels (DEADWEIGHT_NATIVE=0):
         numpy and torch only, what a machine without a C compiler gets;
* peer:  `safetensors.torch.load_file` and per-tensor torch statistics.

Figures: median over rounds of each variant's throughput / the raw variant's in the
same round, and the median peak RSS next to 2 x the largest tensor + 200 MB.

    python benchmarks/inspect_throughput.py [--rounds 3] [--gb 2.1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

import torch
from safetensors.torch import save_file

TENSOR = 32 * 1024 * 1024  # elements per large tensor: 128 MB in fp32

# Both raw variants map the data section the same way (inside the timed part, as
# inspect opens and parses the file inside its own); numpy is imported before it.
_MAPPED = """
    with open(PATH, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    dtype = {"F32": np.float32, "BF16": np.uint16}
    data = np.memmap(PATH, dtype=np.uint8, mode="r", offset=8 + n)
    views = [data[a:b].view(dtype[i["dtype"]]) for i in header.values()
             for a, b in [i["data_offsets"]]]
"""

VARIANTS = {
    "raw": _MAPPED
    + """
    for view in views:
        view.max()
""",
    "raw-2t": _MAPPED
    + """
    from concurrent.futures import ThreadPoolExecutor
    halves = [h for v in views for h in (v[: v.size // 2], v[v.size // 2 :]) if h.size]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(np.max, halves))
""",
    "inspect": """
        import deadweight
        deadweight.inspect_checkpoints([PATH], scheme=None)
    """,
    "inspect+int4": """
        import deadweight
        deadweight.inspect_checkpoints([PATH])
    """,
    "inspect+channel": """
        import deadweight
        deadweight.inspect_checkpoints([PATH], scheme="int8-channel")
    """,
    "inspect+tensor": """
        import deadweight
        deadweight.inspect_checkpoints([PATH], scheme="int4-tensor")
    """,
    "inspect-fallback": """
        import deadweight
        deadweight.inspect_checkpoints([PATH])
    """,
    "peer": """
        import torch
        from safetensors.torch import load_file
        for t in load_file(PATH).values():
            t = t.float()
            t.min(); t.max(); t.mean(); t.std(); (t == 0).sum(); (~torch.isfinite(t)).sum()
    """,
}

RUNNER = """
import os, sys, time
PATH = sys.argv[1]
{imports}
start = time.perf_counter()
{body}
elapsed = time.perf_counter() - start
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({{"seconds": elapsed, "peak_rss_mb": hwm / 1024}}))
"""


def make_file(directory: str, dtype: torch.dtype, gigabytes: float) -> tuple[str, int]:
    path = os.path.join(directory, f"model-{str(dtype).removeprefix('torch.')}.safetensors")
    per = TENSOR * torch.tensor([], dtype=dtype).element_size()
    count = max(1, int(gigabytes * 1e9 // per) + 1)
    gen = torch.Generator().manual_seed(0)
    tensors = {
        f"layers.{i}.weight": torch.randn(TENSOR, generator=gen).to(dtype).reshape(4096, -1)
        for i in range(count)
    }
    for i in range(count):  # small tensors too, as real checkpoints have
        tensors[f"layers.{i}.norm.weight"] = torch.ones(4096, dtype=dtype)
        tensors[f"layers.{i}.layer_scalar"] = torch.ones(1, dtype=dtype)
    save_file(tensors, path)
    # Written to disk before anything is timed: the kernel's writeback of 2 GB of dirty
    # pages would otherwise run beside the first rounds and take a core from them.
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
    return path, per


def run(variant: str, path: str) -> dict[str, float]:
    body = textwrap.dedent(VARIANTS[variant])
    env = dict(os.environ)
    if variant == "inspect-fallback":
        env["DEADWEIGHT_NATIVE"] = "0"
    imports = "import json, struct\nimport numpy as np"
    # Imports are outside the timing, for every variant: numpy (50-70 ms here, about half
    # a raw read of the 2 GB file), deadweight and torch load once per process.
    if "deadweight" in body:
        # the rule modules too: without cached bytecode (PYTHONDONTWRITEBYTECODE) compiling
        # them costs about half a second, which is not reading
        imports += "\nimport deadweight, deadweight.checkpoints.api\ndeadweight.all_rules()"
    if "torch" in body:
        imports += "\nimport torch\nfrom safetensors.torch import load_file"
    # As the command line does after its imports (cli.main): the objects they made are
    # frozen, so no variant pays for the first full walk of them by the cyclic collector
    # (about 70 ms here, due in whichever variant allocates enough after its imports).
    imports += "\nimport gc\ngc.freeze()"
    code = RUNNER.format(imports=imports, body=body)
    done = subprocess.run(
        [sys.executable, "-c", code, path], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def baseline_rss() -> float:
    code = "import json, deadweight, torch, numpy\n" + RUNNER.format(imports="", body="pass")
    done = subprocess.run(
        [sys.executable, "-c", code, "-"], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gb", type=float, default=2.1)
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated subset (raw and raw-2t always run: the ratios need them)",
    )
    args = parser.parse_args()
    chosen = ["raw", "raw-2t"] + [
        v for v in args.variants.split(",") if v in VARIANTS and v not in ("raw", "raw-2t")
    ]
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="dw-bench-inspect-") as directory:
        for dtype in (torch.float32, torch.bfloat16):
            path, largest = make_file(directory, dtype, args.gb)
            size = os.path.getsize(path)
            run("raw", path)  # warm the page cache
            results: dict[str, list[dict[str, float]]] = {v: [] for v in chosen}
            for _ in range(args.rounds):
                for variant in chosen:
                    results[variant].append(run(variant, path))
            budget = 2 * largest / 2**20 + 200
            print(
                f"{os.path.basename(path)}: {size / 1e9:.2f} GB, largest tensor "
                f"{largest / 2**20:.0f} MB, RSS budget {budget:.0f} MB; process baseline "
                f"(python + torch + deadweight imported) {baseline_rss():.0f} MB"
            )
            for variant, runs in results.items():
                ratios = [
                    raw["seconds"] / r["seconds"]
                    for r, raw in zip(runs, results["raw"], strict=True)
                ]
                ratios_2t = [
                    raw["seconds"] / r["seconds"]
                    for r, raw in zip(runs, results["raw-2t"], strict=True)
                ]
                speed = statistics.median(size / r["seconds"] / 1e9 for r in runs)
                rss = statistics.median(r["peak_rss_mb"] for r in runs)
                print(
                    f"  {variant:<16} {speed:6.2f} GB/s  {statistics.median(ratios):6.1%} of raw "
                    f"(rounds {', '.join(f'{x:.2f}' for x in ratios)}), "
                    f"{statistics.median(ratios_2t):6.1%} of raw-2t  peak RSS {rss:6.0f} MB"
                )
            os.remove(path)


if __name__ == "__main__":
    main()
