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

``--start`` measures instead what one rank pays to start training on a set of short text rows
(:func:`make_text_set`, JSONL): a fresh process builds the run's data (``qwenkit.data.build``:
index, sampler, collator) and takes its first micro-batch; it prints the seconds to that batch
and the peak RSS, with the RSS before the data was touched (imports, processor) and their
difference. ``cold`` empties the cache first (the start scans every row), ``warm`` reads the
index. ``--trees`` runs the same measurement on other checkouts (``old=/path/to/main``), so
today's code and another's are compared on the same files::

    python benchmarks/data_scan.py --start --sizes 10000 1000000 --trees new=. old=../main
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


TEXT_ROW = (
    '{{"messages": [{{"role": "user", "content": "{img}Question {i}: which number comes after {i}?"}}, '
    '{{"role": "assistant", "content": "The number {j}."}}]{images}}}'
)
IMAGE_ROWS = 8  # rows with an image, spread evenly, at every size: the rows themselves are text


def make_text_set(root: Path, n: int, suffix: str = ".jsonl") -> Path:
    """``n`` short text conversations (~130 bytes a row), ``IMAGE_ROWS`` of them with one image each.

    Written as JSONL (one row a line) or, with ``suffix=".json"``, as one JSON array; reused when
    already there. 1,000,000 rows take a few seconds and ~130 MB."""
    path = root / f"text-{n}{suffix}"
    if path.is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    image = root / "text-set.png"
    if not image.is_file():
        from PIL import Image

        Image.new("RGB", (56, 56), (120, 60, 30)).save(image)
    every = max(n // IMAGE_ROWS, 1)
    lines = (
        TEXT_ROW.format(
            i=i, j=i + 1, img="<image>" if i % every == 0 else "",
            images=f', "images": ["{image.name}"]' if i % every == 0 else "",
        )
        for i in range(n)
    )  # fmt: skip
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        if suffix == ".jsonl":
            f.writelines(line + "\n" for line in lines)
        else:
            f.write("[\n")
            f.writelines(("" if i == 0 else ",\n") + line for i, line in enumerate(lines))
            f.write("\n]\n")
    tmp.rename(path)
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


def _vm_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def measure_start(path: str, cache_dir: str, num_proc: int, mode: str) -> dict:
    """One rank's start in this (fresh) process: data built, first micro-batch taken."""
    from qwenkit import config as qconfig
    from qwenkit.data import build
    from qwenkit.model.paths import load_processor

    began = time.perf_counter()
    cfg = qconfig.load(
        overrides={"data.path": path, "data.cache_dir": cache_dir, "data.num_proc": num_proc, "train.micro_batch_size": 2}
    )
    processor = load_processor(cfg)
    before = _vm_kib("VmRSS") / 1024
    data_began = time.perf_counter()
    bundle = build(cfg, processor)
    batch = next(bundle.batches())
    done = time.perf_counter()
    return {
        "mode": mode, "rows": len(bundle.dataset), "origin": bundle.dataset.index_origin,
        "first_batch_s": done - began, "data_s": done - data_began, "tokens": int(batch["input_ids"].numel()),
        "rss_before_mib": before, "peak_rss_mib": _vm_kib("VmHWM") / 1024,
    }  # fmt: skip


def run_start(tree: str, path: Path, cache_dir: Path, num_proc: int, mode: str) -> dict:
    if mode == "cold":
        shutil.rmtree(cache_dir, ignore_errors=True)
    result = fresh_process(
        [str(Path(__file__).resolve()), "--measure-start", str(path), str(cache_dir), str(num_proc), mode],
        f"{mode} start of {tree}", env={"PYTHONPATH": str(Path(tree).resolve())}, cwd=tree,
    )  # fmt: skip
    want = "index from cache" if mode == "warm" else "scanned"
    if not result["origin"].startswith(want):
        raise RuntimeError(f"{mode} start did not {want}: {result['origin']}")
    return result


def main_start(args) -> int:
    root = Path(args.root)
    trees = dict(t.split("=", 1) for t in args.trees)
    print(f"{'rows':>9} {'code':<5} {'mode':<5} {'first batch s':>13} {'data s':>7} {'RSS before MiB':>14} "
          f"{'peak RSS MiB':>12} {'data MiB':>8}")  # fmt: skip
    results = {}
    for n in args.sizes:
        path = make_text_set(root, n)
        for label, tree in trees.items():
            cache_dir = root / f"cache-{label}-{n}"
            modes = ["warm"] if n in args.warm_only else ["cold", "warm"]
            for mode in modes:
                r = results[label, mode, n] = run_start(tree, path, cache_dir, args.procs[0], mode)
                print(
                    f"{n:>9} {label:<5} {mode:<5} {r['first_batch_s']:>13.2f} {r['data_s']:>7.2f} "
                    f"{r['rss_before_mib']:>14.0f} {r['peak_rss_mib']:>12.0f} {r['peak_rss_mib'] - r['rss_before_mib']:>8.0f}",
                    flush=True,
                )
    small, large = min(args.sizes), max(args.sizes)  # the targets: RSS <= 1.2x, warm start <= 1.5x
    for label, mode, n in results:
        if n == large and (label, mode, small) in results and small != large:
            a, b = results[label, mode, small], results[label, mode, large]
            print(f"{label} {mode}: {large} vs {small} rows: peak RSS {b['peak_rss_mib'] / a['peak_rss_mib']:.2f}x, "
                  f"first batch {b['first_batch_s'] / a['first_batch_s']:.2f}x")
    return 0


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
    p.add_argument("--start", action="store_true", help="one rank's start on short text rows (see above)")
    p.add_argument("--trees", nargs="+", default=["new=."], help="label=checkout to import qwenkit from (--start)")
    p.add_argument("--warm-only", type=int, nargs="*", default=[], help="sizes whose cache is already built (--start)")
    p.add_argument("--measure", nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--measure-start", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        path, cache_dir, num_proc, mode = args.measure
        print(json.dumps(measure(path, cache_dir, int(num_proc), mode)))
        return 0
    if args.measure_start:
        path, cache_dir, num_proc, mode = args.measure_start
        print(json.dumps(measure_start(path, cache_dir, int(num_proc), mode)))
        return 0
    if args.start:
        return main_start(args)
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
