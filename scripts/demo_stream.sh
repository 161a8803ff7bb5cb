#!/usr/bin/env bash
# The CTR example online, on this machine (docs/guides/online.md): a local NATS broker, a
# producer of click events, 1 ps + 2 workers training on the stream (psframe launch),
# psframe serve following their checkpoints, and a client asking it for predictions.
#   ./scripts/demo_stream.sh [--seconds 60] [--events_per_second 200] [--delta_secs 5] [--save_secs 30]
# The client queries for --seconds from the first version served; then everything this
# script started is stopped by its PID (Ctrl-C stops it sooner). Each process's output is in the
# run's folder, named at the start (DEMO_DIR chooses it). Installs the stream, serve and
# broker extras into .venv on first use.
set -euo pipefail
PSFRAME_EXTRAS="stream,serve,broker${PSFRAME_EXTRAS:+,$PSFRAME_EXTRAS}"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

run_seconds=60 rate=200 delta_secs=5 save_secs=30
while [ $# -gt 0 ]; do
    case "$1" in
        --seconds) run_seconds="$2" ;;
        --events_per_second) rate="$2" ;;
        --delta_secs) delta_secs="$2" ;;
        --save_secs) save_secs="$2" ;;
        -h | --help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "demo_stream.sh: unknown flag $1 (flags: --seconds, --events_per_second, --delta_secs, --save_secs)" >&2; exit 2 ;;
    esac
    [ $# -ge 2 ] || { echo "demo_stream.sh: $1 needs a value" >&2; exit 2; }
    shift 2
done

RUN="${DEMO_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/psframe-demo-stream.XXXXXX")}"
mkdir -p "$RUN"
echo "[demo] the run's folder (logs, broker store, checkpoints): $RUN"
STOP_DEADLINE_S=60  # how long a process gets to stop after SIGTERM before SIGKILL
SHOWN='serving (nats|http)|events published|events trained|psframe serve: (version|stopped)|\[client\]|committed up to|"role"|\[launch\] (cluster|done)'
declare -A PID=()
STARTED=()
SHOWING=""

stop_all() {  # newest first (the client, serve, the cluster, the producer, the broker): SIGTERM, then SIGKILL past the deadline
    trap - EXIT INT TERM
    local name i deadline
    [ -z "$SHOWING" ] || kill -TERM "$SHOWING" 2>/dev/null || true
    for ((i = ${#STARTED[@]} - 1; i >= 0; i--)); do
        name="${STARTED[i]}" deadline=$((SECONDS + STOP_DEADLINE_S))
        kill -TERM "${PID[$name]}" 2>/dev/null || true
        while kill -0 "${PID[$name]}" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
        if kill -0 "${PID[$name]}" 2>/dev/null; then
            echo "[demo] $name (pid ${PID[$name]}) did not stop within ${STOP_DEADLINE_S}s: killing it" >&2
            kill -KILL "${PID[$name]}" 2>/dev/null || true
        fi
        wait "${PID[$name]}" 2>/dev/null || true
    done
    grep -hE 'committed up to|"role"|\[launch\] done|psframe serve: stopped' "$RUN"/{cluster,serve}.log 2>/dev/null || true
    echo "[demo] stopped: ${STARTED[*]}; their output is in $RUN"
}
trap stop_all EXIT
trap 'echo "[demo] interrupted"; exit 130' INT TERM

start() {  # start NAME COMMAND...: in the background and a session of its own (so that Ctrl-C reaches
    # this script alone, which stops it), its output in $RUN/NAME.log
    local name="$1"
    shift
    setsid "$@" > "$RUN/$name.log" 2>&1 < /dev/null &
    PID[$name]=$!
    STARTED+=("$name")
    if [ -z "$SHOWING" ]; then  # from then on, the lines of note of every log, as they come
        tail -q -n +1 -F --pid=$$ "$RUN"/{broker,producer,cluster,serve,client}.log 2> /dev/null \
            > >(grep --line-buffered -E "$SHOWN") &
        SHOWING=$!
    fi
}

alive() {  # fail, with its log's tail, if process NAME has exited
    kill -0 "${PID[$1]}" 2>/dev/null && return 0
    echo "[demo] $1 exited early; the end of $RUN/$1.log:" >&2
    tail -n 20 "$RUN/$1.log" >&2
    exit 1
}

url_of() {  # url_of NAME PATTERN SECONDS: the first match of PATTERN in NAME's output, within SECONDS
    local deadline=$((SECONDS + $3)) found
    while [ $SECONDS -lt $deadline ]; do
        found="$(grep -m1 -oE "$2" "$RUN/$1.log" 2>/dev/null || true)"
        [ -n "$found" ] && { echo "$found"; return 0; }
        alive "$1"
        sleep 0.2
    done
    echo "[demo] $1 did not say where it serves within $3 s; the end of $RUN/$1.log:" >&2
    tail -n 20 "$RUN/$1.log" >&2
    exit 1
}

start broker python -m psframe.streams.local_broker --store_dir "$RUN/nats"
broker_url="$(url_of broker 'nats://[0-9.]+:[0-9]+' 60)"

start producer python examples/ctr_stream.py --role=producer --broker_url "$broker_url" \
    --events_per_second "$rate"
start cluster psframe launch --num_ps 1 --num_workers 2 --timeout $((run_seconds + 600)) examples/ctr_stream.py -- \
    --broker_url "$broker_url" --checkpoint_dir "$RUN/ckpt" --save_secs "$save_secs" --delta_secs "$delta_secs"
start serve psframe serve --checkpoint_dir "$RUN/ckpt" --model examples/ctr_stream.py:serving \
    --poll_seconds 0.5
serve_url="$(url_of serve 'http://[0-9.]+:[0-9]+' 120)"

start client python examples/ctr_stream.py --role=client --serve_url "$serve_url" --seconds "$run_seconds"
deadline=$((SECONDS + run_seconds + 660))  # the client waits 600 s at most for a first version
while kill -0 "${PID[client]}" 2>/dev/null; do
    for name in broker producer cluster serve; do alive "$name"; done
    if [ $SECONDS -ge $deadline ]; then
        echo "[demo] the client did not finish within $((run_seconds + 660)) s" >&2
        exit 1
    fi
    sleep 1
done
wait "${PID[client]}"
