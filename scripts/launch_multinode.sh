#!/usr/bin/env bash
# Start this node's share of a multi-node job: run it once on every node, with the same arguments for train.py.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash scripts/launch_multinode.sh --config configs/... --output_dir /shared/out
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash scripts/launch_multinode.sh --config configs/... --output_dir /shared/out
#
# Environment (defaults in brackets):
#   NNODES [1]            number of nodes in the job
#   NODE_RANK [0]         this node's index, 0..NNODES-1
#   MASTER_ADDR [127.0.0.1]  address of the node that hosts the rendezvous store (reachable from every node)
#   MASTER_PORT [29500]   free TCP port on MASTER_ADDR
#   NPROC_PER_NODE [gpu]  processes per node ("gpu": one per visible GPU; on CPU give a number)
#   RDZV_ID [qlora]       job id shared by all nodes; a new id per job avoids joining a stale rendezvous
#   RDZV_BACKEND [c10d]   c10d: nodes may start in any order and torchrun assigns node ranks as they join, so
#                         NODE_RANK is not used and global rank 0 (which writes metrics.jsonl and the adapter)
#                         can land on any node; static: node NODE_RANK gets global ranks NODE_RANK*NPROC_PER_NODE..
#   TORCHRUN [torchrun]   the torchrun executable
# Put --output_dir on a filesystem every node shares. Arguments are passed to train.py unchanged; relative paths in
# them are relative to the current directory (run from the repository root, like every README command).
set -euo pipefail
REPO_ROOT=$(cd "$(dirname "$0")/.." && pwd)

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-gpu}
RDZV_BACKEND=${RDZV_BACKEND:-c10d}
TORCHRUN=${TORCHRUN:-torchrun}

node_rank_args=()
if [[ "$RDZV_BACKEND" == "static" ]]; then
    # torchrun ignores --node_rank (with a warning) for any other backend.
    node_rank_args=(--node_rank "$NODE_RANK")
fi

exec "$TORCHRUN" \
    --nnodes "$NNODES" \
    ${node_rank_args[@]+"${node_rank_args[@]}"} \
    --nproc_per_node "$NPROC_PER_NODE" \
    --rdzv_backend "$RDZV_BACKEND" \
    --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" \
    --rdzv_id "${RDZV_ID:-qlora}" \
    "$REPO_ROOT/train.py" "$@"
