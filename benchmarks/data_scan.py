"""Dataset scan at scale: cold scan with 1 and 2 processes, warm start from the index cache.

Generates its own datasets under ``--root`` (default ``/tmp/qwenkit-data-scan``): N rows cycling
the six mllm_demo conversations (8 images per 6 rows), every image under its own file name
(hard links to the three demo JPEGs, copies where links fail), so no image is measured twice.
Each measurement runs in a fresh process with the default run config (tiny processor,
``data.verify_images: header``), and prints:

- cold scan rows/s with ``data.num_proc`` 1 and 2 (rows read, bad-row checks and token counts
  included) and their ratio;
- warm start: a fresh process opening the dataset and reading its index from the cache
  (fingerprint + index file), and, separately, the first sample (which parses the JSON file);
- the index's bytes per good row and the peak RSS of the measuring process (its scan
  processes' peak in brackets) — one rank's share;
- the CPU seconds of the measurement (the process and its scan processes) and, from them, the
  wall time the scan would take on free cores: the serial part (the process's own CPU) plus the
  scan processes' CPU divided by their number. On a shared machine the kernel gives a session
  one share of the CPUs however many processes it runs, so measured wall-time ratios there say
  nothing about parallelism; the CPU columns still do.

    python benchmarks/data_scan.py                      # 20k and 100k rows
    python benchmarks/data_scan.py --sizes 20000 --procs 1 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

from qwenkit.bench.measure import fresh_process

DEMO = Path(__file__).resolve().parents[2] / "shared" / "data" / "mllm_demo" / "mllm_demo.json"  # a sibling of the checkout


def make_dataset(root: Path, n: int, demo: Path = DEMO) -> Path:
    """``n`` rows of the demo set with distinct image file names; reused when already there."""
    out = root / f"rows-{n}"
    path = out / "data.json"
    if path.is_file():
        return path
    tmp = root / f".rows-{n}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "img").mkdir(parents=True)
    demo_rows = json.loads(demo.read_text())
    rows = []
    for i in range(n):
        row = dict(demo_rows[i % len(demo_rows)])
        images = []
        for k, image in enumerate(row.get("images", [])):
            name = f"img/{i:07d}_{k}{Path(image).suffix}"
            try:
                os.link(demo.parent / image, tmp / name)
            except OSError:
                shutil.copyfile(demo.parent / image, tmp / name)
            images.append(name)
        row["images"] = images
        row["id"] = str(i)
        rows.append(row)
    (tmp / "data.json").write_text(json.dumps(rows))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return path


def _children_peak_rss_mib() -> float:
    """The largest scan worker's peak RSS (getrusage: /proc/self cannot see children)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def _cpu_s(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def measure(path: str, cache_dir: str, num_proc: int, mode: str) -> dict:
    """One measurement in this (fresh) process: ``cold`` scans and writes, ``warm`` reads."""
    from qwenkit import config as qconfig
    from qwenkit.data import read_dataset
    from qwenkit.device import memory_bytes
    from qwenkit.model.paths import load_processor

    cfg = qconfig.load(overrides={"data.path": path, "data.cache_dir": cache_dir, "data.num_proc": num_proc})
    processor = load_processor(cfg)
    began, cpu = time.perf_counter(), _cpu_s(resource.RUSAGE_SELF)
    dataset, report = read_dataset(cfg.data, processor)
    seconds = time.perf_counter() - began
    cpu = _cpu_s(resource.RUSAGE_SELF) - cpu
    first = time.perf_counter()
    dataset[0]
    first = time.perf_counter() - first
    return {
        "mode": mode, "num_proc": num_proc, "rows": report.total, "good": len(dataset), "seconds": seconds,
        "first_sample_s": first, "origin": dataset.index_origin, "bytes_per_row": dataset.index.bytes_per_row(),
        "rss_mib": memory_bytes("cpu", peak=True) / 2**20, "children_rss_mib": _children_peak_rss_mib(),
        "cpu_s": cpu, "children_cpu_s": _cpu_s(resource.RUSAGE_CHILDREN),
    }  # fmt: skip


def run(path: Path, cache_dir: Path, num_proc: int, mode: str) -> dict:
    if mode == "cold":
        shutil.rmtree(cache_dir, ignore_errors=True)
    result = fresh_process([__file__, "--measure", str(path), str(cache_dir), str(num_proc), mode],
                           f"{mode} scan of {path}", allocator={})  # fmt: skip
    want = "index from cache" if mode == "warm" else "scanned"
    if not result["origin"].startswith(want):
        raise RuntimeError(f"{mode} run did not {want}: {result['origin']}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="/tmp/qwenkit-data-scan")
    p.add_argument("--sizes", type=int, nargs="+", default=[20_000, 100_000])
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--measure", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        path, cache_dir, num_proc, mode = args.measure
        print(json.dumps(measure(path, cache_dir, int(num_proc), mode)))
        return 0
    root = Path(args.root)
    print(
        f"{'rows':>7} {'mode':<5} {'procs':>5} {'wall s':>7} {'rows/s':>7} {'vs 1':>5} {'CPU s (procs)':>14} "
        f"{'free-core s':>11} {'rows/s':>7} {'vs 1':>5} {'B/row':>6} {'peak RSS MiB (procs)':>20}"
    )
    for n in args.sizes:
        path = make_dataset(root, n)
        cache_dir = root / f"cache-{n}"
        base = base_free = None
        for num_proc in args.procs:
            r = run(path, cache_dir, num_proc, "cold")
            rate = r["rows"] / r["seconds"]
            free = r["cpu_s"] + r["children_cpu_s"] / num_proc if num_proc > 1 else r["cpu_s"]
            base, base_free = base or rate, base_free or r["rows"] / free
            print(
                f"{n:>7} {'cold':<5} {num_proc:>5} {r['seconds']:>7.2f} {rate:>7.0f} {rate / base:>4.2f}x "
                f"{r['cpu_s']:>6.1f} ({r['children_cpu_s']:>5.1f}) {free:>11.2f} {r['rows'] / free:>7.0f} "
                f"{r['rows'] / free / base_free:>4.2f}x {r['bytes_per_row']:>6.1f} {r['rss_mib']:>9.0f} ({r['children_rss_mib']:.0f})"
            )
        r = run(path, cache_dir, 1, "warm")
        print(
            f"{n:>7} {'warm':<5} {'':>5} {r['seconds']:>7.2f} {'':>7} {'':>5} {r['cpu_s']:>6.2f} {'':>7} {'':>11} {'':>7} {'':>5} "
            f"{r['bytes_per_row']:>6.1f} {r['rss_mib']:>9.0f}   first sample (parses the JSON): {r['first_sample_s']:.2f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
