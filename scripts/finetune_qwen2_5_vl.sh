#!/usr/bin/env bash
# Fine-tune Qwen2.5-VL with qwenkit (FSDP2 through torchrun). Run it once per node.
#
#   scripts/finetune_qwen2_5_vl.sh CONFIG [key.path=value ...]
#
#   scripts/finetune_qwen2_5_vl.sh params/qwen2_5_vl_7b_gpu.yaml train.steps=2000
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 scripts/finetune_qwen2_5_vl.sh params/qwen2_5_vl_7b_npu.yaml
#
# Environment (default: the scheduler's, under Slurm, a PyTorchJob or PAI-DLC; else the one given):
#   NPROC        processes on this node (parallel.nproc from the config)
#   NNODES       number of nodes (1), or MIN:MAX (torchrun's c10d rendezvous: docs/CLUSTERS.md)
#   NODE_RANK    this node's index, 0 .. NNODES-1 (0)
#   MASTER_ADDR  address of node 0 (127.0.0.1)
#   MASTER_PORT  rendezvous port on node 0 (a free port on one node; 6000 with NNODES > 1)
#   QWENKIT      the command to run ("qwenkit"; e.g. "python -m qwenkit.cli")
# Exits with qwenkit's status: non-zero when the config is invalid or any rank fails.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed -E 's/^# ?//'
}

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
  usage >&2
  exit 2
fi
config=$1
shift
if [[ ! -f $config ]]; then
  echo "finetune_qwen2_5_vl.sh: config file '$config' not found" >&2
  exit 2
fi

read -r -a qwenkit_cmd <<< "${QWENKIT:-qwenkit}"
args=(train --config "$config")
# only what was given: qwenkit train reads the rest from the scheduler (qwenkit/cluster.py)
if [[ -n ${NNODES:-} ]]; then
  args+=(--nnodes "$NNODES")
fi
if [[ -n ${NODE_RANK:-} ]]; then
  args+=(--node-rank "$NODE_RANK")
fi
if [[ -n ${MASTER_ADDR:-} ]]; then
  args+=(--master-addr "$MASTER_ADDR")
fi
if [[ -n ${MASTER_PORT:-} ]]; then
  args+=(--master-port "$MASTER_PORT")
fi
if [[ -n ${NPROC:-} ]]; then
  args+=(--nproc "$NPROC")
fi
args+=("$@")

exec "${qwenkit_cmd[@]}" "${args[@]}"
