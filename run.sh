#!/usr/bin/env bash
# Every launch mode of the collection, runnable on this machine.
#
#   bash run.sh              run every mode (GPUs with NCCL when present, else 2 CPU processes with gloo)
#   bash run.sh MODE...      run the named modes
#   bash run.sh --help       list the modes
#
# Each mode prints a header, the script's own output and a PASS/FAIL line that checks
# the metrics the script wrote (training finished, loss fell, replicas in sync).
# The exit code is non-zero when any mode failed. Work files go to a temporary
# directory that is removed at the end (keep it with KEEP_WORK=1).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
if command -v torchrun >/dev/null 2>&1; then TORCHRUN=(torchrun); else TORCHRUN=("$PY" -m torch.distributed.run); fi

# ---------------------------------------------------------------- machine
# detect_machine: N processes on DEVICE. Called only when modes run or are listed: importing
# torch takes seconds, which `bash run.sh bench` and a mistyped mode need not wait for.
detect_machine() {
    NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"  # CUDA_VISIBLE_DEVICES counts
    if [ "$NGPU" -gt 0 ]; then
        N="$NGPU"; DEVICE=cuda; SMALL=(); TEST_SAMPLES="(10000 if m['dataset'] == 'mnist' else 1000)"
    else
        # on CPU the MNIST modes train on part of the (synthetic) data: the launch is the lesson. 501 test
        # samples: 2 ranks do not divide it, so a sampler that padded (and counted one sample twice) would show
        N=2; DEVICE=cpu; SMALL=(--train_samples 1500 --test_samples 501); TEST_SAMPLES=501
    fi
}

WORK="$(mktemp -d "${TMPDIR:-/tmp}/ddp-run.XXXXXX")"
cleanup() {
    # no worker of ours outlives the script, even after Ctrl-C or a failed mode
    pkill -P $$ >/dev/null 2>&1 || true
    if [ "${KEEP_WORK:-0}" = 1 ]; then echo "work files kept in $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# gpu_list FIRST COUNT: COUNT of the visible GPUs from the FIRST on, as CUDA_VISIBLE_DEVICES wants them
# (indexes into a CUDA_VISIBLE_DEVICES that SLURM or a container set, rather than replacing it)
gpu_list() {
    local visible
    IFS=, read -r -a visible <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((NGPU - 1)))}"
    local IFS=,
    echo "${visible[*]:$1:$2}"
}

# wait_all PID...: wait for every one; fails if any failed
wait_all() {
    local rc=0 p
    for p in "$@"; do wait "$p" || rc=1; done
    return $rc
}

# check_metrics FILE [PYTHON-CONDITION...]: the run finished, the loss fell, replicas agree
check_metrics() {
    local file="$1"; shift
    "$PY" - "$file" "$@" <<'EOF'
import json, math, sys
path, extra = sys.argv[1], sys.argv[2:]
try:
    m = json.load(open(path))
except (OSError, ValueError) as e:
    sys.exit(f"FAIL: no metrics ({e})")
checks = ["m['replicas_in_sync'] is True"] + (extra or ["m['final_loss'] < m['first_loss']"])
bad = [c for c in checks if not eval(c, {"m": m, "math": math})]
summary = ", ".join(f"{k}={m[k]:.4g}" if isinstance(m.get(k), float) else f"{k}={m.get(k)}"
                    for k in ("world_size", "backend", "epochs", "steps", "first_loss", "final_loss",
                              "resumed_from_epoch", "restarts") if k in m)
if bad:
    sys.exit(f"FAIL: {'; '.join(bad)} ({summary})")
print(f"ok: {summary}")
EOF
}

# ---------------------------------------------------------------- modes
declare -A DESC
MODES=()     # run by `bash run.sh`
EXTRA=()     # run only when named: features beyond the launch modes, root-only modes
mode() { MODES+=("$1"); DESC[$1]="$2"; }
extra_mode() { EXTRA+=("$1"); DESC[$1]="$2"; }

mode minimal "ddp_minimal.py: one DDP step with mp.spawn, replicas identical"
run_minimal() {
    # the smallest file writes no metrics: its done: line is the check
    "$PY" "$HERE/ddp_minimal.py" | tee out.txt && grep -q "| parameters changed | replicas in sync" out.txt \
        && echo "ok: parameters changed, replicas in sync"
}

mode spawn "ddp_gpus.py: mp.spawn, one process per GPU (2 on CPU)"
run_spawn() {
    "$PY" "$HERE/ddp_gpus.py" --max_epochs 5 --batch_size 32 --metrics m.json && check_metrics m.json
}

mode torchrun "ddp_gpus_torchrun.py: torchrun --standalone --nproc-per-node=N"
run_torchrun() {
    "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_gpus_torchrun.py" \
        --max_epochs 5 --batch_size 32 --metrics m.json && check_metrics m.json
}

extra_mode torchrun-single "ddp_gpus_torchrun.py: plain torchrun, one process"
run_torchrun-single() {
    "${TORCHRUN[@]}" "$HERE/ddp_gpus_torchrun.py" --max_epochs 5 --batch_size 32 --metrics m.json \
        && check_metrics m.json "m['world_size'] == 1" "m['final_loss'] < m['first_loss']"
}

extra_mode template "ddp_template.py: the porting template, 2 epochs with exact validation, then --resume to 3"
run_template() {
    "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_template.py" --epochs 2 --metrics m.json \
        && check_metrics m.json "m['val_samples'] == 1001" "m['val_loss'] < m['val_losses'][0]" \
        && "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_template.py" --epochs 3 --resume \
            --metrics m.json \
        && check_metrics m.json "m['resumed_from_epoch'] == 2" "m['epochs'] == 3" "m['val_loss'] < m['val_losses'][0]"
}

mode launch "ddp_gpus_torchrun.py: the deprecated python -m torch.distributed.launch"
run_launch() {
    # passes --local-rank=N to the script (which accepts it); prints a FutureWarning
    "$PY" -m torch.distributed.launch --nproc-per-node="$N" "$HERE/ddp_gpus_torchrun.py" \
        --max_epochs 5 --batch_size 32 --metrics m.json && check_metrics m.json
}

mode manual "ddp_gpus_torchrun.py: N processes started by hand with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT"
run_manual() {
    # the seeds' two-machine recipe on one machine: each process is told its place in the job
    local port pids=() r
    port="$(free_port)"
    for ((r = 0; r < N; r++)); do
        RANK=$r LOCAL_RANK=$r WORLD_SIZE=$N MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            "$PY" "$HERE/ddp_gpus_torchrun.py" --max_epochs 5 --batch_size 32 --metrics m.json &
        pids+=($!)
    done
    wait_all "${pids[@]}" && check_metrics m.json "m['world_size'] == $N" "m['final_loss'] < m['first_loss']"
}

mode nodes "ddp_gpus_torchrun.py: two torchrun agents as two nodes (--nnodes=2 --node-rank=0/1) on 127.0.0.1"
run_nodes() {
    local port per_node=$((N / 2)) dev=() pids=() node gpus
    port="$(free_port)"
    if [ "$per_node" -lt 1 ]; then per_node=1; dev=(--device cpu); fi  # one GPU cannot host two ranks
    # both "nodes" share this machine's cores, but each agent counts only its own processes (torchrun sets
    # OMP_NUM_THREADS=1 only for more than one per node): unset, each process would take every core
    local threads=$(( $(nproc) / (2 * per_node) ))
    [ "$threads" -ge 1 ] || threads=1
    for node in 0 1; do
        # each "node" sees its own half of the GPUs, as two machines would: with all of them
        # visible, local rank r on both nodes would pick GPU r and NCCL refuses the duplicate
        gpus="$(gpu_list $((node * per_node)) "$per_node")"
        [ "$DEVICE" = cuda ] && [ ${#dev[@]} = 0 ] || gpus="${CUDA_VISIBLE_DEVICES-}"
        OMP_NUM_THREADS="${OMP_NUM_THREADS:-$threads}" CUDA_VISIBLE_DEVICES="$gpus" \
            "${TORCHRUN[@]}" --nnodes=2 --node-rank=$node --nproc-per-node=$per_node \
            --master-addr=127.0.0.1 --master-port="$port" "$HERE/ddp_gpus_torchrun.py" \
            --max_epochs 5 --batch_size 32 --metrics m.json "${dev[@]}" &
        pids+=($!)
    done
    wait_all "${pids[@]}" && check_metrics m.json "m['world_size'] == $((2 * per_node))" \
        "m['final_loss'] < m['first_loss']"
}

mode restart "ddp_gpus_torchrun.py: torchrun --max-restarts=3; a worker is killed, the job resumes from its snapshot"
run_restart() {
    # a bigger data set so that an epoch lasts long enough to kill a worker in the middle of one
    # (a GPU runs this model ~30x faster: 32x the samples, or the job ends before the kill lands)
    local agent worker i samples=8192
    [ "$DEVICE" = cuda ] && samples=262144
    # the tutorial's command, nothing set: each attempt joins in a namespace of torchrun's store of
    # its own (the harness's attempt_store), so restarted workers never read the dead ones' addresses
    "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" --max-restarts=3 "$HERE/ddp_gpus_torchrun.py" \
        --max_epochs 4 --samples "$samples" --batch_size 16 --metrics m.json &
    agent=$!
    for ((i = 0; i < 600; i++)); do [ -e ddp_gpus_torchrun.pt ] && break; sleep 0.1; done
    worker="$(pgrep -P "$agent" | tail -1)"
    if [ -z "$worker" ]; then echo "FAIL: no worker to kill"; wait "$agent"; return 1; fi
    echo ">>> snapshot written; killing worker $worker with SIGKILL"
    kill -9 "$worker"
    wait "$agent" && check_metrics m.json "m['restarts'] >= 1" "m['resumed_from_epoch'] >= 1" "m['epochs'] == 4"
}

mode main "ddp_main.py: the seed's MNIST ConvNet with mp.spawn, --gpu 0,..,N-1 -e 3 -b 32 (synthetic stand-in without MNIST)"
run_main() {
    # the seed's --gpu 0,1, as the GPUs this machine has (a 1-GPU job has no GPU 1; 2 CPU processes on CPU)
    "$PY" "$HERE/ddp_main.py" --gpu "$(seq -s, 0 $((N - 1)))" -e 3 -b 32 "${SMALL[@]}" --metrics m.json \
        && check_metrics m.json "m['test_accuracy'] > 0.9" "m['final_loss'] < m['first_loss']" \
            "m['test_samples'] == $TEST_SAMPLES"
}

mode main-torchrun "ddp_main_torchrun.py: torchrun --standalone --nproc_per_node=N --gpu 0,..,N-1"
run_main-torchrun() {
    "${TORCHRUN[@]}" --standalone --nproc_per_node="$N" "$HERE/ddp_main_torchrun.py" \
        --gpu "$(seq -s, 0 $((N - 1)))" "${SMALL[@]}" --metrics m.json \
        && check_metrics m.json "m['world_size'] == $N" "m['test_accuracy'] > 0.9" "m['final_loss'] < m['first_loss']"
}

extra_mode main-manual "ddp_main_torchrun.py: 2 processes started by hand with RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT"
run_main-manual() {
    # the seed's multi-machine recipe on one machine: each process is told its place in the job
    local port pids=() r dev=()
    port="$(free_port)"
    if [ "$DEVICE" = cuda ] && [ "$N" -lt 2 ]; then dev=(--device cpu); fi  # one GPU cannot host two ranks
    for r in 0 1; do
        RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            "$PY" "$HERE/ddp_main_torchrun.py" "${SMALL[@]}" --metrics m.json "${dev[@]}" &
        pids+=($!)
    done
    wait_all "${pids[@]}" && check_metrics m.json "m['world_size'] == 2" "m['test_accuracy'] > 0.9"
}

extra_mode main-resume "ddp_main.py: 2 epochs, --resume to 3, then --evaluate the checkpoint in one process"
run_main-resume() {
    # one process evaluates in other batches than two, so under autocast a near-tie may flip: 0.5% slack
    "$PY" "$HERE/ddp_main.py" -e 2 "${SMALL[@]}" --metrics m2.json \
        && "$PY" "$HERE/ddp_main.py" -e 3 --resume "${SMALL[@]}" --metrics m.json \
        && check_metrics m.json "m['resumed_from_epoch'] == 2" "m['epochs'] == 3" "m['test_accuracy'] > 0.9" \
        && "$PY" "$HERE/ddp_main_torchrun.py" --evaluate "${SMALL[@]}" --metrics m1.json \
        && check_metrics m1.json "m['world_size'] == 1" "m['steps'] == 0" "m['epochs'] == 3" \
            "abs(m['test_accuracy'] - $("$PY" -c 'import json; print(json.load(open("m.json"))["test_accuracy"])')) < 0.005"
}

mode transformer "ddp_transformer.py: torchrun --standalone --nproc-per-node=N, character LM on the stdlib"
run_transformer() {
    "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_transformer.py" --sample 100 --metrics m.json \
        && check_metrics m.json "m['val_loss'] < m['first_val_loss'] - 1" "m['val_loss'] < m['unigram_entropy']"
}

extra_mode transformer-accum "ddp_transformer.py: --grad_accum 4 (no_sync on 3 of 4 micro-batches), then --resume one more epoch"
run_transformer-accum() {
    local cmd=("${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_transformer.py" --grad_accum 4
               --batch_size 4 --d_model 64 --num_layers 2 --sample 0 --metrics m.json)
    "${cmd[@]}" --epochs 1 && "${cmd[@]}" --epochs 2 --resume \
        && check_metrics m.json "m['resumed_from_epoch'] == 1" "m['epochs'] == 2" "m['val_loss'] < m['unigram_entropy']"
}

extra_mode transformer-toy "ddp_transformer.py --dataset toy: the seed's experiment (12 constant rows, SGD 0.01), loss falls"
run_transformer-toy() {
    "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_transformer.py" --dataset toy --metrics m.json \
        && check_metrics m.json
}

extra_mode uneven "ddp_uneven.py: unequal shards per rank trained to the end with Join: every sample once, replicas agree"
run_uneven() {
    "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_uneven.py" --metrics m.json \
        && check_metrics m.json "m['every_sample_once'] is True" \
           "m['samples_trained'] == [m['dataset_size']] * m['epochs']" "m['final_loss'] < m['first_loss']"
}

extra_mode uneven-zero "ddp_uneven.py --zero: ZeroRedundancyOptimizer with Join, checkpoint at epoch 2, --resume to 3"
run_uneven-zero() {
    local cmd=("${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_uneven.py" --zero --checkpoint ck.pt)
    "${cmd[@]}" -e 2 --metrics m0.json && "${cmd[@]}" -e 3 --resume --metrics m.json \
        && check_metrics m.json "m['resumed_from_epoch'] == 2" "m['every_sample_once'] is True" \
           "m['world_size'] == 1 or max(m['optimizer_state_bytes_per_rank']) < sum(m['optimizer_state_bytes_per_rank'])"
}

extra_mode comm-hooks "ddp_comm_hooks.py: allreduce, fp16, bf16, PowerSGD hooks side by side; bytes counted, loss gap"
run_comm-hooks() {
    "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_comm_hooks.py" --metrics m.json \
        && check_metrics m.json "m['world_size'] == $N" "m['final_loss'] < m['first_loss']" \
            "2 * m['hooks']['fp16']['bytes_per_step'] == m['hooks']['allreduce']['bytes_per_step']" \
            "m['hooks']['powersgd']['compression'] > 10" "abs(m['hooks']['fp16']['loss_gap']) < 0.02"
}

extra_mode desync "ddp_desync.py: a rank that skips a step alone, fixed by deciding together: same steps on every rank"
run_desync() {
    "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_desync.py" --bug skip-step --fix --metrics m.json \
        && check_metrics m.json "len(set(m['steps_per_rank'])) == 1" "m['skipped_per_rank'] == [m['bad_batches']] * m['world_size']" \
           "m['final_loss'] < m['first_loss']"
}

extra_mode unused "ddp_unused.py: parameters without a gradient: the error named (--mode bare, exit 1), then find-unused vs static-graph"
run_unused() {
    local rc
    "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_unused.py" --mode bare 2> err.txt
    rc=$?
    grep '^error:' err.txt
    if [ "$rc" != 1 ] || ! grep -q '^error: .*rank 0: .*heads\.b\.weight' err.txt; then
        echo "FAIL: --mode bare should exit 1 naming rank 0's unused parameters (exit $rc)"; return 1
    fi
    "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_unused.py" --mode static-graph --metrics m.json \
        && check_metrics m.json "m['checks']['spare_unchanged'] is True" "m['final_loss'] < m['first_loss']" \
            "m['checks']['max_difference_static_vs_find_unused'] < 1e-5"
}

extra_mode slow "ddp_slow.py: a straggler planted (the verdict names the last rank), then fixed (faster, no straggler verdict)"
run_slow() {
    "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_slow.py" --cause straggler --max_steps 30 \
        --metrics planted.json > planted.txt && grep '^verdict:' planted.txt | tail -1 \
    && check_metrics planted.json "m['verdict'] == 'straggler'" "m['slowest_rank'] == m['world_size'] - 1" \
        "m['final_loss'] < m['first_loss']" \
    && "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_slow.py" --cause straggler --fix --max_steps 30 \
        --metrics fixed.json > fixed.txt && grep '^verdict:' fixed.txt | tail -1 \
    && check_metrics fixed.json "m['verdict'] != 'straggler'" "m['final_loss'] < m['first_loss']" \
    && "$PY" - <<'EOF'
import json, sys
planted, fixed = (json.load(open(name)) for name in ("planted.json", "fixed.json"))
ratio = fixed["samples_per_s"] / planted["samples_per_s"]
print(f"ok: fixed, {ratio:.2f}x the samples a second ({planted['step_ms']:.1f} -> {fixed['step_ms']:.1f} ms a step)")
sys.exit(ratio <= 1)
EOF
}

extra_mode fsdp "fsdp_transformer.py: FSDP2 on N processes, its sharded checkpoint resumed by 1, --export loaded by ddp_transformer.py"
run_fsdp() {
    local cmd=("$HERE/fsdp_transformer.py" --sample 0 --checkpoint ck)
    "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "${cmd[@]}" --max_steps 30 --lr_decay_steps 60 --metrics m0.json \
        && check_metrics m0.json "m['world_size'] == $N" "sum(m['memory_per_rank']['param_bytes']) == 4 * m['params']" \
        && "${TORCHRUN[@]}" --standalone --nproc-per-node=1 "${cmd[@]}" --max_steps 60 --resume --export whole.pt \
            --metrics m.json \
        && check_metrics m.json "m['world_size'] == 1" "m['steps'] == 30" "m['val_loss'] < m['unigram_entropy']" \
        && "$PY" -c "import sys, torch; sys.path.insert(0, '$HERE'); from ddp_transformer import Transformer
c = torch.load('whole.pt', weights_only=True); Transformer(**c['config']).load_state_dict(c['model'])
print('ok: whole.pt loads into ddp_transformer.Transformer')"
}

extra_mode bandwidth "ddp_bandwidth.py: all_reduce, all_gather, reduce_scatter timed at 4 KiB to 256 MiB; the link, a verdict"
run_bandwidth() {
    # a probe, not a training: the check is one result per op and size, each correct and above 0
    "${TORCHRUN[@]}" --standalone --nproc-per-node="$N" "$HERE/ddp_bandwidth.py" --metrics m.json \
        && check_metrics m.json "m['world_size'] == $N" "m['results_correct'] is True" \
            "len(m['results']) == 3 * sum(r['op'] == 'all_reduce' for r in m['results']) >= 3" \
            "min(r['busbw_GBps'] for r in m['results']) > 0" "m['bucket_busbw_GBps'] > 0"
}

# ---------------------------------------------------------------- modes beyond one machine (root)
# two "hosts" on one machine: network namespaces joined by a veth pair (root only)
NETNS=(ddprun$$h0 ddprun$$h1)
NETNS_ADDR=(10.77.0.1 10.77.0.2)   # exists only inside the two namespaces

netns_up() {
    if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null 2>&1; then
        echo "skip: needs root and iproute2 (ip netns)"; return 1
    fi
    # run.sh runs each mode in a subshell: this trap removes the hosts however the mode ends
    trap netns_down EXIT
    trap 'exit 130' INT TERM
    if ! { ip netns add "${NETNS[0]}" && ip netns add "${NETNS[1]}"; }; then
        echo "skip: ip netns add failed (no network namespaces here)"; return 1
    fi
    # both ends are created inside the namespaces: the machine's own network never sees them
    ip link add ddp0 netns "${NETNS[0]}" type veth peer name ddp0 netns "${NETNS[1]}" || return 1
    for i in 0 1; do
        ip -n "${NETNS[i]}" addr add "${NETNS_ADDR[i]}/24" dev ddp0 &&
        ip -n "${NETNS[i]}" link set lo up && ip -n "${NETNS[i]}" link set ddp0 up || return 1
        # each host gets a hostname (below) that its /etc/hosts resolves, as on a real network
        # (`ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts)
        mkdir -p "/etc/netns/${NETNS[i]}"
        printf '127.0.0.1 localhost\n%s ddp-host0\n%s ddp-host1\n' "${NETNS_ADDR[@]}" \
            > "/etc/netns/${NETNS[i]}/hosts"
        echo "host$i: ${NETNS[i]}, ${NETNS_ADDR[i]} on ddp0"
    done
}

netns_down() {
    local n
    for n in "${NETNS[@]}"; do
        ip netns pids "$n" 2>/dev/null | xargs -r kill -9 2>/dev/null
        ip netns del "$n" 2>/dev/null
        rm -rf "/etc/netns/$n"
    done
    return 0
}

# netns_train RDZV-ARGS...: one torchrun agent per host, 2 CPU processes each, gloo on ddp0
netns_train() {
    local pids=() i
    for i in 0 1; do
        # gloo binds the interface named here; without it, it binds what the hostname resolves to
        # unshare --uts: a hostname of its own, which torchrun hands to the other host
        CUDA_VISIBLE_DEVICES= GLOO_SOCKET_IFNAME=ddp0 ip netns exec "${NETNS[i]}" \
            unshare --uts sh -c 'hostname "$0" && exec "$@"' "ddp-host$i" \
            "${TORCHRUN[@]}" "${@//NODE_RANK/$i}" --nproc-per-node=2 "$HERE/ddp_gpus_torchrun.py" \
            --device cpu --max_epochs 5 --batch_size 32 --snapshot_path "host$i.pt" --metrics m.json &
        pids+=($!)
    done
    wait_all "${pids[@]}" && check_metrics m.json "m['world_size'] == 4" "m['final_loss'] < m['first_loss']"
}

extra_mode netns "ddp_gpus_torchrun.py: two hosts (network namespaces + veth, root only), --nnodes=2 --node-rank=0/1"
run_netns() {
    netns_up || return 0
    netns_train --nnodes=2 --node-rank=NODE_RANK --master-addr="${NETNS_ADDR[0]}" --master-port=29500
}

extra_mode netns-elastic "ddp_gpus_torchrun.py: two hosts (network namespaces + veth, root only), c10d --nnodes=1:2"
run_netns-elastic() {
    netns_up || return 0
    # host0 hosts the c10d store: its hostname resolves to 10.77.0.1, the endpoint's address
    # (a host that cannot tell needs --rdzv-conf=is_host=1 there)
    netns_train --nnodes=1:2 --rdzv-backend=c10d --rdzv-endpoint="${NETNS_ADDR[0]}:29400" \
        --rdzv-id=run-sh --rdzv-conf=join_timeout=120,last_call_timeout=30
}

# ---------------------------------------------------------------- driver
usage() {
    echo "usage: bash run.sh [MODE...]    (no MODE: every mode under 'modes')"
    detect_machine
    echo "machine: N = $N processes on $DEVICE"
    echo "modes:"
    for m in "${MODES[@]}"; do printf '  %-18s %s\n' "$m" "${DESC[$m]}"; done
    echo "run only when named:"
    printf '  %-18s %s\n' bench "the benchmark: E(N) beside the machine's limit; --all adds threads, DP vs DDP, hooks, ZeRO"
    for m in "${EXTRA[@]}"; do printf '  %-18s %s\n' "$m" "${DESC[$m]}"; done
}

main() {
    local selected=() results=() failed=0 m start rc
    if [ "${1:-}" = bench ]; then
        # the benchmark: its own table, bench_results.json in the current directory
        shift
        "$PY" "$HERE/bench.py" "$@"
        return
    fi
    for m in "$@"; do
        case "$m" in
            -h|--help|help) usage; return 0 ;;
            *) if [ -z "${DESC[$m]+x}" ]; then echo "error: unknown mode '$m' (bash run.sh --help lists them)" >&2; return 2; fi
               selected+=("$m") ;;
        esac
    done
    [ ${#selected[@]} -eq 0 ] && selected=("${MODES[@]}")
    detect_machine
    echo "run.sh: ${#selected[@]} mode(s) on $N x $DEVICE | work files in $WORK"
    for m in "${selected[@]}"; do
        echo
        echo "================ $m: ${DESC[$m]}"
        mkdir -p "$WORK/$m"
        start=$SECONDS
        (cd "$WORK/$m" && "run_$m")
        rc=$?
        if [ $rc = 0 ]; then results+=("PASS  $m ($((SECONDS - start)) s)")
        else results+=("FAIL  $m ($((SECONDS - start)) s, exit $rc)"); failed=$((failed + 1)); fi
        echo "---------------- ${results[-1]}"
    done
    echo
    echo "================ summary"
    printf '%s\n' "${results[@]}"
    echo "$(( ${#selected[@]} - failed )) passed, $failed failed"
    [ $failed = 0 ]
}

main "$@"
