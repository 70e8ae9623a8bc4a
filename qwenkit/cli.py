"""The ``qwenkit`` command: train, data check, export, eval, vllm-serve, sweep, notebooks.

Each subcommand lives in the module that owns its concern; this file only parses and dispatches.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from qwenkit import config as qconfig
from qwenkit.errors import TRACEBACK_ENV, KnownCause, print_user_error, said_by_another_rank

# a dotted override (train.steps=30), wherever it stands among the options
OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.\w+)+=")


class UserError(Exception):
    """A subcommand's input cannot be used (a checkpoint that is not one, ...): one line, exit 2."""


# What a subcommand raises for bad input: by the project's convention a ValueError that names the
# key, file or row (ConfigError, DataError, BadSample, ExportError are ValueErrors), or a missing
# or unwritable file. They print one line, never a traceback, and exit 2 (`train` and `data
# check` always did); so does a failure of a known cause that says its fix (KnownCause: vLLM's KV cache
# too small under `eval --engine vllm`); anything else is a bug and keeps its traceback.
USER_ERRORS = (UserError, ValueError, OSError, KnownCause)


# Each subcommand imports its own stack when it runs, so `qwenkit --help` or a data check does
# not load torch.distributed, and `notebooks run` alone needs the notebooks extra.


def _train(args) -> int:
    from qwenkit import cluster, launch  # torch.distributed and the model: train only

    # flags, else the scheduler's environment (Slurm, PyTorchJob, PAI-DLC); a contradiction is a ClusterError
    rdzv, nproc, source = cluster.resolve({k: getattr(args, k) for k in cluster.FLAGS}, os.environ)
    return launch.launch(args.config, args.overrides, nproc, rdzv, source)  # logs the rendezvous once


def _on_dataset(args, command, overrides=()) -> int:
    """``command(cfg)`` on the config of ``qwenkit data check|prepare``, its dataset the PATH argument."""
    cfg = qconfig.load(args.config, [*args.overrides, *overrides])  # a ConfigError: one line, exit 2 (main)
    cfg.data.path = args.path
    return command(cfg)


def _data_check(args) -> int:
    from qwenkit.data import check  # tokenizer and image stack: data check only

    return _on_dataset(args, check.check)


def _data_prepare(args) -> int:
    from qwenkit.data import prepare  # tokenizer and image stack: data prepare only

    return _on_dataset(args, prepare.prepare, [f"data.num_proc={args.num_proc}"] if args.num_proc is not None else [])


def _export(args) -> int:
    from qwenkit.engine.checkpoints import dcp, export  # torch.distributed.checkpoint: export only

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = qconfig.load(args.config or dcp.run_config_path(args.checkpoint), rewards=False)  # never called here
        out = export.export(args.checkpoint, args.out, cfg, merge=args.merge, overwrite=args.overwrite)
    except dcp.CheckpointError as e:
        raise UserError(e) from e
    print(f"exported {dcp.resolve(args.checkpoint)} to {out}")
    return 0


def _eval(args) -> int:
    from qwenkit.engine.generation import eval_command  # the model and generation stack: eval only

    request = eval_command.EvalRequest(
        args.target, data=args.data, samples=args.samples, config=args.config, out=args.out,
        metric=tuple(args.metric) if args.metric is not None else None, nproc=args.nproc, batch_size=args.batch_size,
        engine=args.engine,
    )  # fmt: skip
    try:
        return eval_command.eval_main(request)
    except eval_command.ckpt.CheckpointError as e:
        raise UserError(e) from e


def _vllm_serve(args) -> int:
    from qwenkit.engine.generation import vllm_server  # vLLM, FastAPI and uvicorn: vllm-serve only

    return vllm_server.serve(qconfig.load(args.config, args.overrides, rewards=False), args.host, args.port)


def _notebooks(args) -> int:
    from qwenkit.notebooks import runner  # papermill and nbconvert (the notebooks extra): notebooks only

    out_dir, outcomes = runner.run(args.params, args.only, args.out, args.run_name,
                                   cell_timeout=args.cell_timeout)  # bad input: main's one line; fmt: skip
    print(f"index: {out_dir / 'index.html'}")
    return 0 if all(o.status == "passed" for o in outcomes) else 1


def _sweep(args) -> int:
    from qwenkit import sweep  # the launcher's checks (torch.distributed, the model): sweep only

    if args.sweep_command == "status":
        return sweep.status_command(args.dir)
    return sweep.run_command(args.file, args.out, args.parallel, args.stop_on_failure, args.cpu_parallel)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qwenkit", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    # every subcommand takes --traceback (argparse gives a subparser only the options it was built with)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--traceback", action="store_true",
                        help="on an input error, print the full traceback above the one-line message (for a bug report)")

    def leaf(subparsers, *a, **k):
        return subparsers.add_parser(*a, parents=[common], **k)

    t = leaf(sub, "train", help="train with FSDP2 through torchrun")
    t.add_argument("--config", default=None, help="params/*.yaml (default: built-in tiny defaults)")
    t.add_argument("--nproc", type=int, default=None, help="processes on this node (overrides parallel.nproc)")
    # unset: the scheduler's (Slurm, PyTorchJob, PAI-DLC; see qwenkit/cluster.py), else one node
    t.add_argument("--nnodes", default=None,
                   help="nodes in the job, N or MIN:MAX (c10d; default: the scheduler's, else 1)")
    t.add_argument("--node-rank", type=int, default=None, help="this node's index (default: the scheduler's, else 0)")
    t.add_argument("--master-addr", default=None, help="node 0's address (default: the scheduler's, else 127.0.0.1)")
    t.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port (default: the scheduler's; a free port on one node, 6000 with --nnodes > 1)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=30")
    t.set_defaults(func=_train)

    d = sub.add_parser("data", help="dataset tools")
    dsub = d.add_subparsers(dest="data_command", required=True)
    c = leaf(dsub, "check", help="validate a dataset and print a summary; non-zero exit on bad samples")
    c.add_argument("path", help="JSON/JSONL file, directory, HF dataset directory, or 'tiny'")
    c.add_argument("--config", default=None, help="params/*.yaml whose data/model sections to use")
    c.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_length=2048")
    c.set_defaults(func=_data_check)
    pr = leaf(dsub, "prepare", help="scan a dataset and write its index cache (data.cache_dir) before training")
    pr.add_argument("path", help="JSON/JSONL file, directory, HF dataset directory, or 'tiny'")
    pr.add_argument("--config", default=None, help="the run's params/*.yaml (its data/model sections key the cache)")
    pr.add_argument("--num-proc", type=int, default=None, help="scan processes (overrides data.num_proc)")
    pr.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_length=2048")
    pr.set_defaults(func=_data_prepare)

    e = leaf(sub, "export", help="export a checkpoint to a Hugging Face safetensors directory")
    e.add_argument("checkpoint", help="checkpoint directory (a step-N folder, or a run's output_dir for the newest)")
    e.add_argument("out", help="output directory")
    e.add_argument("--config", default=None, help="the run's params/*.yaml (default: the one saved with the run)")
    e.add_argument("--merge", action="store_true",
                   help="LoRA runs: a full HF directory with the adapters merged (default: a peft adapter directory)")
    e.add_argument("--overwrite", action="store_true", help="replace a previous export in OUT (else OUT must be new or empty)")
    e.set_defaults(func=_export)

    v = leaf(sub, "eval", help="eval loss and answer accuracy of a run, checkpoint or export")
    v.add_argument("target", metavar="RUN_OR_CHECKPOINT", help="a run's output_dir, a step-N checkpoint, or an export")
    v.add_argument("--data", default=None, help="eval dataset (default: the run's eval set)")
    v.add_argument("--samples", type=int, default=None, help="rows to generate for accuracy (default: train.eval_samples)")
    v.add_argument("--config", default=None, help="params/*.yaml (default: the one saved with the run)")
    v.add_argument("--out", default=None, help="generations JSONL (default: RUN_OR_CHECKPOINT/eval/cli-<name>.jsonl)")
    v.add_argument("--metric", nargs="+", default=None, metavar="NAME",
                   help="exact normalized relaxed anls or module:function, several at once (default: train.eval_metrics)")
    v.add_argument("--nproc", type=int, default=1, help="ranks on this node, each generating its share of the rows")
    v.add_argument("--batch-size", type=int, default=None, help="prompts per generate call (default: train.eval_batch_size)")
    v.add_argument("--engine", choices=("hf", "vllm"), default=None,
                   help="what generates: HF generate or a vLLM engine given the weights (default: train.eval_engine)")
    v.set_defaults(func=_eval)

    s = leaf(sub, "vllm-serve", help="serve a run's vLLM engine to its ranks (vllm.mode=server vllm.server_url=...)")
    s.add_argument("--config", default=None, help="the run's params/*.yaml: its model, dtype, lengths and pixel bounds")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: this host only; 0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000, TRL's)")
    s.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_length=2048")
    s.set_defaults(func=_vllm_serve)

    w = sub.add_parser("sweep", help="run many training runs from a sweep file, and show their ledger")
    wsub = w.add_subparsers(dest="sweep_command", required=True)
    wr = leaf(wsub, "run", help="run (or resume) every trial of params/sweeps/<name>.yaml")
    wr.add_argument("file", help="sweep file: base, overrides, grid, trials, seeds")
    wr.add_argument("--out", default=None, help="sweep folder (default: runs/sweeps/<name>)")
    wr.add_argument("--parallel", type=int, default=1, help="trials at once, each on its own CUDA/NPU devices")
    wr.add_argument("--stop-on-failure", action="store_true", help="start no more trials after one fails")
    wr.add_argument("--cpu-parallel", action="store_true", help="allow --parallel > 1 on CPU (trials share the cores)")
    wr.set_defaults(func=_sweep)
    ws = leaf(wsub, "status", help="print a sweep folder's ledger as a table")
    ws.add_argument("dir", help="the sweep folder (holds sweep.jsonl)")
    ws.set_defaults(func=_sweep)

    n = sub.add_parser("notebooks", help="run the notebooks with papermill and render HTML reports")
    nsub = n.add_subparsers(dest="notebooks_command", required=True)
    r = leaf(nsub, "run", help="execute notebooks into reports/<run>/ and write index.html")
    r.add_argument("--params", default="default", help="parameter set name under params/<notebook>/")
    r.add_argument("--only", nargs="*", default=None, help="notebook names or numbers to run")
    r.add_argument("--out", default="reports", help="reports folder")
    r.add_argument("--run-name", default=None, help="sub-folder name (default: timestamp)")
    r.add_argument("--cell-timeout", type=int, default=None, metavar="S",
                   help="fail a notebook whose cell runs longer than S seconds (default: no limit)")  # fmt: skip
    r.set_defaults(func=_notebooks)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    overrides = [a for a in argv if OVERRIDE.match(a)]
    args = build_parser().parse_args([a for a in argv if not OVERRIDE.match(a)])
    if hasattr(args, "overrides"):
        args.overrides = overrides + list(args.overrides)
    elif overrides:
        print(f"qwenkit {args.command}: takes no overrides, got {' '.join(overrides)}", file=sys.stderr)
        return 2
    command = " ".join(str(getattr(args, k)) for k in ("command", "data_command", "notebooks_command") if hasattr(args, k))
    if args.traceback:
        os.environ[TRACEBACK_ENV] = "1"
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        if not said_by_another_rank(e):  # under eval --nproc, rank 0 says what every rank met
            print_user_error(command, e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
