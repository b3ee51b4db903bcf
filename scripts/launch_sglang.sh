#!/usr/bin/env bash
# launch_sglang.sh: run one rollout instance on this box and keep it registered with the rollout manager.
# `scripts/launch_sglang.sh --help` documents it; rollout_manager/launch/box.py holds its helpers.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch_sglang.sh --model-path PATH [options] [-- SGLANG_FLAGS...]
       ROLLOUT_MANAGER_ADDR=http://<ip>:<port> launch_sglang.sh --model-path PATH --port 30000

Starts one rollout instance on this box: SGLang (or the CPU engine) plus the weight receiver agent,
waits until both answer, registers the instance with the rollout manager, and keeps them running.
On Ctrl-C or SIGHUP it deregisters (the manager drains the instance: no new work, in-flight
requests finish), then stops both children. SIGTERM is a preemption notice unless --preemption-notice
off (below): the manager moves the work off the box while it keeps serving, then the children stop. If SGLang or the agent dies, it deregisters, stops the
other and exits. A second Ctrl-C skips the drain. Nothing is left running when it exits; if the
launcher itself is killed (kill -9) its children get SIGTERM from the kernel.

While serving it checks the manager every --reregister-check-s seconds (GET /health). When the
manager restarted (its run_id changed: a new process with an empty registry) it registers the box
again with the same body and logs one line. Only a new run_id does that: an instance an admin removed
with /shutdown_instances stays out (one log line says so; restart the launcher to rejoin). While the
manager is unreachable the box keeps serving and the launcher keeps checking quietly (one line when
it goes away, one when it is back); it never stops SGLang because the manager is down.

Before anything heavy starts it checks, and reports in one line on stderr:
  - that --port and --transfer-agent-handshake-port are distinct and free on this box,
  - that the manager answers GET /health (waiting up to --wait-for-manager seconds),
  - that the interpreter can import what the instance needs.

Manager and box:
  --manager-addr ADDR     the manager, http://<ip>:<port> (a bare <ip>:<port> gets http://).
                          Default: $ROLLOUT_MANAGER_ADDR (or $ROLLOUT_MANAGER_ADDRESS).
  --host HOST             this box's address as the manager and the trainer's weight senders reach it.
                          Default: detected, the source address of this box's route to the manager.
  --bind ADDR             address SGLang and the agent listen on (default: --host; 0.0.0.0 for all).
  --port PORT             SGLang's HTTP port (default 30000). Each instance on a box needs its own.
  --transfer-agent-handshake-port PORT
                          the weight receiver agent's control port (HTTP; the manager drives weight
                          loads through it and registers it as weight_receiver_port). Default:
                          --port + 1111, outside SGLang's own range (--port+100..+1000 for NCCL).
                          Mooncake's P2P handshake/RPC port is not set here: Mooncake picks a free
                          one itself (15000-17000 unless MC_MIN_RPC_PORT/MC_MAX_RPC_PORT say
                          otherwise); the agent reports it and it is registered as
                          mooncake_handshake_port. So several instances on one box never collide on it.
                          Alias: --receiver-port.

Engine:
  --engine sglang|cpu     what serves /generate (default sglang; env ROLLOUT_MANAGER_ENGINE).
                          cpu runs `python -m rollout_manager.cpu_engine` (tiny model on CPU, for CI
                          and demos; pass-through flags such as --seed, --token-delay-s,
                          --die-after-tokens go to it; --model-path is ignored).
  --model-path PATH       the model SGLang loads (required for --engine sglang).
  --vocab-size N          the model's vocabulary size, sent at registration so the manager refuses
                          input ids at or past it (SGLang's scheduler dies on one and does not report
                          the size). Default: read from the model's config.json (a local directory, or
                          a hub id already in the Hugging Face cache).
  --python PY             interpreter for SGLang, the agent and the helpers (env PYTHON; default
                          python3 on PATH). It needs sglang, and rollout-manager with Mooncake
                          (pip install 'rollout-manager[cuda]'); this checkout is put on PYTHONPATH.
  --deterministic         add --enable-deterministic-inference: bit-identical continuation of a
                          sequence on another instance (the manager continues sequences whose box
                          dies) at some throughput cost. Without it a continued greedy sequence
                          can differ from an uninterrupted one after the switch.
  --api-key KEY           SGLang's --api-key (env ROLLOUT_SGLANG_API_KEY); also read when given after --.
  --admin-api-key KEY     SGLang's --admin-api-key (env ROLLOUT_SGLANG_ADMIN_API_KEY); also read after --.
                          SGLang then needs the API key on /generate, /server_info and /model_info, and
                          the admin key (else the API key) on its weight, flush and abort endpoints. The
                          launcher passes both to SGLang, hands them to the receiver agent in its
                          environment, and uses the API key for its own /server_info check. Give the
                          manager the same keys: sglang_api_key / sglang_admin_api_key (config.toml).
  --no-metrics            do not add --enable-metrics (the manager reads /metrics when it is there).
  --no-incremental-streaming
                          do not add --incremental-streaming-output (SGLang's default: every stream
                          chunk repeats the whole output so far, which costs the manager more CPU
                          per relayed token; the manager warns about such instances).
  Other arguments, and everything after --, go to SGLang (or the CPU engine) unchanged, e.g.
  -- --tp-size 2 --mem-fraction-static 0.8. Added by default for SGLang: --enable-metrics,
  --weight-version 0 (yours win); for both engines: --incremental-streaming-output. The tokenizer is kept (no --skip-tokenizer-init): the manager
  sends token ids, and the tokenizer still serves text requests and detokenized output.

Weight receiver agent:
  --mooncake-protocol tcp|rdma   transport for incoming weights (default tcp).
  --mooncake-device-name NAMES   RDMA NICs, comma-separated (default: all).
  --receiver-arg ARG      extra argument for the agent, repeatable (e.g. --receiver-arg=--engines=2).

Preemption notices (the manager moves the work off a box before its cloud takes it back):
  --preemption-notice auto|aws|gce|azure|sigterm|off
                          where notices come from (default auto; env ROLLOUT_PREEMPTION_NOTICE).
                          aws: EC2 Spot's spot/instance-action (IMDSv2, checked every 5 s; two minutes'
                          notice). gce: the metadata server's instance/preempted, waited on (about 30 s).
                          azure: Scheduled Events of type Preempt or Terminate for this VM, checked every
                          second (NotBefore; at least 30 s). auto: whichever of the three answers at
                          start (all asked at once, 1 s each), else SIGTERM alone. Every mode but off
                          also treats SIGTERM as a notice: the box reports --sigterm-grace-s seconds
                          left, keeps serving until the manager has removed it (or the time is
                          spent), then stops. off: SIGTERM deregisters and drains, as Ctrl-C does.
                          A withdrawn notice (Azure's event gone, AWS's item gone, GCE back to FALSE),
                          or one the box outlives by 60 s, is taken back: the box returns to service.
  --sigterm-grace-s S     seconds between SIGTERM and the kill (default 30, Kubernetes' default
                          terminationGracePeriodSeconds): set it to your pod's, Slurm's GraceTime, ...
  --preemptible auto|true|false
                          register the box as one its cloud may take back (default auto: true when
                          the metadata service says this is a spot/preemptible machine).
  --price-per-hour P      what the box costs per hour, registered for the status and the scaling signal.
  --start-when-wanted     before loading the model, wait until the manager's scaling signal wants more
                          boxes of this kind (preemptible or not, price; fleet_demand in
                          /get_instances_status; a kind it has not seen yet starts when it wants any),
                          checking every --reregister-check-s seconds: a warm pool of launchers that
                          start as they are wanted. Several waiting launchers may start for one wanted box.
  --aws-metadata-url URL, --gce-metadata-url URL, --azure-metadata-url URL
                          the metadata services (default http://169.254.169.254; env
                          ROLLOUT_AWS_METADATA_URL, ROLLOUT_GCE_METADATA_URL, ROLLOUT_AZURE_METADATA_URL).

Timing:
  --ready-timeout-s S     how long SGLang and the agent may take to answer (default 1800: large
                          models load and compile for a long time). The manager then checks
                          /health_generate itself, with its own grace period.
  --drain-timeout-s S     how long deregistration waits for in-flight requests (default 60).
  --stop-timeout-s S      SIGTERM to SIGKILL grace for the children (default 30).
  --reregister-check-s S  how often to check that the manager has not restarted (default 5).
  --wait-for-manager S    at the start, wait up to S seconds for the manager to answer GET /health
                          (default 0: fail at once), for boxes that start together with the trainer.
  --dry-run               print the commands it would run, then exit (no checks, nothing started).
  -h, --help              this text.

Environment:
  ROLLOUT_MANAGER_ADDR        the manager's address (as --manager-addr; ROLLOUT_MANAGER_ADDRESS, the
                              older name, is read when it is unset).
  ROLLOUT_MANAGER_AUTH_TOKEN  when set, sent as "Authorization: Bearer <token>" on every manager call
                              but deregistration, which uses the box token the registration returned
                              (it can remove this instance and nothing else).
  ROLLOUT_MANAGER_ENGINE      sglang or cpu (as --engine).
  ROLLOUT_PREEMPTION_NOTICE   as --preemption-notice.
  PYTHON                      the interpreter (as --python).
  ROLLOUT_SGLANG_API_KEY, ROLLOUT_SGLANG_ADMIN_API_KEY
                              SGLang's keys (as --api-key, --admin-api-key), without them on this
                              launcher's command line.
  MC_*                        Mooncake settings, seen by the agent (e.g. MC_LOG_LEVEL=ERROR).
  SGLANG_USE_CPU_ENGINE=1     SGLang on a CPU-only box (what the real_sglang tests run; docs/real-sglang.md):
                              with OMP_NUM_THREADS=1 and, after --, --device cpu --attention-backend
                              torch_native --sampling-backend pytorch --disable-cuda-graph --dtype float32
                              --sleep-on-idle (an idle scheduler otherwise spins a core).

Network: the manager must reach --port and --transfer-agent-handshake-port on --host; the trainer's
weight senders must reach Mooncake's port range (TCP 15000-17000 by default, RDMA for rdma) on --host.

Supervisors: a terminal's Ctrl-C reaches only this launcher (the children run in their own process
groups), so the drain happens before SGLang stops. A supervisor that signals every process (not only
this launcher) stops SGLang at once: the manager then handles the box as a crash. Under systemd use KillMode=mixed (the default
control-group sends SIGTERM to SGLang at the same time); give Kubernetes pods a
terminationGracePeriodSeconds of --sigterm-grace-s (or, with --preemption-notice off, above
--drain-timeout-s + --stop-timeout-s).

Exit status: 0 stopped by a signal, after deregistering; 1 a check or the start-up failed
(port in use, manager unreachable, not ready in time, registration refused); 2 bad usage;
3 SGLang or the agent died while serving.

Example, two instances on one 8-GPU box:
  export ROLLOUT_MANAGER_ADDR=http://10.0.0.1:5000
  CUDA_VISIBLE_DEVICES=0,1,2,3 scripts/launch_sglang.sh --model-path Qwen/Qwen3-8B --port 30000 -- --tp-size 4
  CUDA_VISIBLE_DEVICES=4,5,6,7 scripts/launch_sglang.sh --model-path Qwen/Qwen3-8B --port 30001 -- --tp-size 4
EOF
}

log() { printf 'launch_sglang: %s\n' "$*" >&2 || true; }  # a closed terminal must not stop the shutdown
usage_error() { printf 'launch_sglang: error: %s (see --help)\n' "$*" >&2; exit 2; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# ------------------------------------------------------------------ arguments
MANAGER_ADDR=${ROLLOUT_MANAGER_ADDR:-${ROLLOUT_MANAGER_ADDRESS:-}}
ENGINE=${ROLLOUT_MANAGER_ENGINE:-sglang}
PY=${PYTHON:-python3}
MODEL_PATH="" VOCAB_SIZE="" HOST="" BIND="" PORT=30000 AGENT_PORT=""
PROTOCOL=tcp DEVICE_NAME="" DETERMINISTIC=0 METRICS=1 INCREMENTAL=1 DRY_RUN=0
READY_TIMEOUT=1800 DRAIN_TIMEOUT=60 STOP_TIMEOUT=30 RECHECK=5 WAIT_MANAGER=0
NOTICE=${ROLLOUT_PREEMPTION_NOTICE:-auto} GRACE=30 PREEMPTIBLE=auto PRICE="" METADATA_ARGS=() WHEN_WANTED=0
RECEIVER_ARGS=() EXTRA=()
API_KEY=${ROLLOUT_SGLANG_API_KEY:-} ADMIN_API_KEY=${ROLLOUT_SGLANG_ADMIN_API_KEY:-}

need_value() { [[ $# -ge 2 ]] || usage_error "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  arg=$1
  if [[ $arg == --*=* ]]; then  # --opt=value -> --opt value, for our own options only
    case ${arg%%=*} in
      --manager-addr|--model-path|--vocab-size|--host|--bind|--port|--transfer-agent-handshake-port|--receiver-port|\
      --engine|--python|--mooncake-protocol|--mooncake-device-name|--receiver-arg|--ready-timeout-s|\
      --drain-timeout-s|--stop-timeout-s|--reregister-check-s|--wait-for-manager|--api-key|--admin-api-key|\
      --preemption-notice|--sigterm-grace-s|--preemptible|--price-per-hour|--aws-metadata-url|\
      --gce-metadata-url|--azure-metadata-url)
        shift; set -- "${arg%%=*}" "${arg#*=}" "$@"; continue ;;
    esac
  fi
  case $arg in
    -h|--help) usage; exit 0 ;;
    --manager-addr) need_value "$@"; MANAGER_ADDR=$2; shift 2 ;;
    --model-path) need_value "$@"; MODEL_PATH=$2; shift 2 ;;
    --vocab-size) need_value "$@"; VOCAB_SIZE=$2; shift 2 ;;
    --host) need_value "$@"; HOST=$2; shift 2 ;;
    --bind) need_value "$@"; BIND=$2; shift 2 ;;
    --port) need_value "$@"; PORT=$2; shift 2 ;;
    --transfer-agent-handshake-port|--receiver-port) need_value "$@"; AGENT_PORT=$2; shift 2 ;;
    --engine) need_value "$@"; ENGINE=$2; shift 2 ;;
    --python) need_value "$@"; PY=$2; shift 2 ;;
    --mooncake-protocol) need_value "$@"; PROTOCOL=$2; shift 2 ;;
    --mooncake-device-name) need_value "$@"; DEVICE_NAME=$2; shift 2 ;;
    --receiver-arg) need_value "$@"; RECEIVER_ARGS+=("$2"); shift 2 ;;
    --api-key) need_value "$@"; API_KEY=$2; shift 2 ;;
    --admin-api-key) need_value "$@"; ADMIN_API_KEY=$2; shift 2 ;;
    --deterministic) DETERMINISTIC=1; shift ;;
    --no-metrics) METRICS=0; shift ;;
    --no-incremental-streaming) INCREMENTAL=0; shift ;;
    --ready-timeout-s) need_value "$@"; READY_TIMEOUT=$2; shift 2 ;;
    --drain-timeout-s) need_value "$@"; DRAIN_TIMEOUT=$2; shift 2 ;;
    --stop-timeout-s) need_value "$@"; STOP_TIMEOUT=$2; shift 2 ;;
    --reregister-check-s) need_value "$@"; RECHECK=$2; shift 2 ;;
    --wait-for-manager) need_value "$@"; WAIT_MANAGER=$2; shift 2 ;;
    --preemption-notice) need_value "$@"; NOTICE=$2; shift 2 ;;
    --sigterm-grace-s) need_value "$@"; GRACE=$2; shift 2 ;;
    --preemptible) need_value "$@"; PREEMPTIBLE=$2; shift 2 ;;
    --price-per-hour) need_value "$@"; PRICE=$2; shift 2 ;;
    --aws-metadata-url|--gce-metadata-url|--azure-metadata-url)
      need_value "$@"; METADATA_ARGS+=("${1%-metadata-url}-url" "$2"); shift 2 ;;  # the helper's --aws-url, ...
    --start-when-wanted) WHEN_WANTED=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; EXTRA+=("$@"); break ;;
    *) EXTRA+=("$arg"); shift ;;  # SGLang's own flags, passed through in order
  esac
done

# SGLang's own --api-key/--admin-api-key given after --: taken out, and handled as the options above.
if (( ${#EXTRA[@]} )); then
  rest=() i=0
  while (( i < ${#EXTRA[@]} )); do
    case ${EXTRA[i]} in
      --api-key|--admin-api-key)
        (( i + 1 < ${#EXTRA[@]} )) || usage_error "${EXTRA[i]} needs a value"
        if [[ ${EXTRA[i]} == --api-key ]]; then API_KEY=${EXTRA[i+1]}; else ADMIN_API_KEY=${EXTRA[i+1]}; fi
        i=$((i + 2)) ;;
      --api-key=*) API_KEY=${EXTRA[i]#*=}; i=$((i + 1)) ;;
      --admin-api-key=*) ADMIN_API_KEY=${EXTRA[i]#*=}; i=$((i + 1)) ;;
      *) rest+=("${EXTRA[i]}"); i=$((i + 1)) ;;
    esac
  done
  EXTRA=(${rest[@]+"${rest[@]}"})
fi
# The agent and the helpers read them from the environment (never from their command lines).
export ROLLOUT_SGLANG_API_KEY=$API_KEY ROLLOUT_SGLANG_ADMIN_API_KEY=$ADMIN_API_KEY

is_port() { [[ $1 =~ ^[1-9][0-9]{0,4}$ ]] && (( $1 <= 65535 )); }
is_num() { [[ $1 =~ ^[0-9]+([.][0-9]+)?$ ]]; }
is_port "$PORT" || usage_error "--port must be a port number, got '$PORT'"
[[ -z $VOCAB_SIZE || $VOCAB_SIZE =~ ^[1-9][0-9]{0,9}$ ]] || usage_error "--vocab-size must be a positive integer, got '$VOCAB_SIZE'"
[[ -n $AGENT_PORT ]] || AGENT_PORT=$(( PORT + 1111 <= 65535 ? PORT + 1111 : PORT - 1111 ))
is_port "$AGENT_PORT" || usage_error "--transfer-agent-handshake-port must be a port number, got '$AGENT_PORT'"
for pair in "ready-timeout-s:$READY_TIMEOUT" "drain-timeout-s:$DRAIN_TIMEOUT" "stop-timeout-s:$STOP_TIMEOUT" \
            "reregister-check-s:$RECHECK" "wait-for-manager:$WAIT_MANAGER" "sigterm-grace-s:$GRACE"; do
  is_num "${pair#*:}" || usage_error "--${pair%%:*} must be a number of seconds, got '${pair#*:}'"
done
STOP_TIMEOUT=${STOP_TIMEOUT%%.*}
case $ENGINE in sglang|cpu) ;; *) usage_error "--engine must be sglang or cpu, got '$ENGINE'" ;; esac
case $NOTICE in auto|aws|gce|azure|sigterm|off) ;; *) usage_error "--preemption-notice must be auto, aws, gce, azure, sigterm or off, got '$NOTICE'" ;; esac
case $PREEMPTIBLE in auto|true|false) ;; *) usage_error "--preemptible must be auto, true or false, got '$PREEMPTIBLE'" ;; esac
[[ -z $PRICE ]] || is_num "$PRICE" || usage_error "--price-per-hour must be a number >= 0, got '$PRICE'"
[[ $GRACE =~ [1-9] ]] || usage_error "--sigterm-grace-s must be above 0, got '$GRACE'"
case $PROTOCOL in tcp|rdma) ;; *) usage_error "--mooncake-protocol must be tcp or rdma, got '$PROTOCOL'" ;; esac
[[ $ENGINE == cpu || -n $MODEL_PATH ]] || usage_error "--model-path is required for --engine sglang"
[[ -n $MANAGER_ADDR ]] || usage_error "no manager address: set ROLLOUT_MANAGER_ADDR=http://<ip>:<port> or pass --manager-addr"
command -v "$PY" >/dev/null 2>&1 || usage_error "no python interpreter '$PY' (set --python or PYTHON)"

# The helpers and the agent come from this checkout when the script runs from one.
if [[ -f $ROOT/rollout_manager/launch/box.py ]]; then
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
box() { "$PY" -m rollout_manager.launch.box "$@"; }

MANAGER=$(box normalize-addr "$MANAGER_ADDR") || exit 1
[[ -n $HOST ]] || HOST=$(box detect-host --manager "$MANAGER") || exit 1
[[ -n $BIND ]] || BIND=$HOST
case $BIND in 0.0.0.0|::) LOCAL=$HOST ;; *) LOCAL=$BIND ;; esac
url() { if [[ $1 == *:* ]]; then echo "http://[$1]:$2"; else echo "http://$1:$2"; fi; }
ENGINE_URL=$(url "$LOCAL" "$PORT")
AGENT_URL=$(url "$LOCAL" "$AGENT_PORT")

if [[ $ENGINE == sglang ]]; then
  ENGINE_NAME=SGLang
  ENGINE_CMD=("$PY" -m sglang.launch_server --model-path "$MODEL_PATH" --host "$BIND" --port "$PORT"
              --weight-version 0)
  (( METRICS )) && ENGINE_CMD+=(--enable-metrics)
  (( DETERMINISTIC )) && ENGINE_CMD+=(--enable-deterministic-inference)
  [[ -n $API_KEY ]] && ENGINE_CMD+=(--api-key "$API_KEY")
  [[ -n $ADMIN_API_KEY ]] && ENGINE_CMD+=(--admin-api-key "$ADMIN_API_KEY")
  MODULES=sglang,aiohttp,torch,mooncake
else
  ENGINE_NAME="CPU engine"
  [[ -z $API_KEY$ADMIN_API_KEY ]] || usage_error "--api-key/--admin-api-key are SGLang's: the CPU engine has no keys"
  ENGINE_CMD=("$PY" -m rollout_manager.cpu_engine --host "$BIND" --port "$PORT")
  MODULES=aiohttp,torch,mooncake
fi
(( INCREMENTAL )) && ENGINE_CMD+=(--incremental-streaming-output)
ENGINE_CMD+=(${EXTRA[@]+"${EXTRA[@]}"})
AGENT_CMD=("$PY" -m rollout_manager.weights.receiver_agent --host "$HOST" --bind "$BIND" --port "$AGENT_PORT"
           --sglang-url "$ENGINE_URL" --protocol "$PROTOCOL")
[[ -n $DEVICE_NAME ]] && AGENT_CMD+=(--device-name "$DEVICE_NAME")
AGENT_CMD+=(${RECEIVER_ARGS[@]+"${RECEIVER_ARGS[@]}"})

if (( DRY_RUN )); then
  shown=()  # keys are not printed
  for a in "${ENGINE_CMD[@]}"; do if [[ -n $a && ( $a == "$API_KEY" || $a == "$ADMIN_API_KEY" ) ]]; then shown+=("<key>"); else shown+=("$a"); fi; done
  printf 'manager: %s\nhost: %s\nengine:' "$MANAGER" "$HOST"; printf ' %q' "${shown[@]}"; echo
  printf 'agent:'; printf ' %q' "${AGENT_CMD[@]}"; echo
  printf 'preemption notices: %s (SIGTERM grace %ss)\n' "$NOTICE" "$GRACE"
  exit 0
fi

# ------------------------------------------------------------------ checks, before anything heavy
box preflight --manager "$MANAGER" --bind "$BIND" --port "$PORT" --agent-port "$AGENT_PORT" \
  --modules "$MODULES" --wait-for-manager "$WAIT_MANAGER" >/dev/null || exit 1

# Which metadata service gives notices (auto: whichever answers), and whether this is a spot machine.
PROVIDER="" SPOT=""
case $NOTICE in
  auto|aws|gce|azure)
    detected=$(box notice-detect --mode "$NOTICE" ${METADATA_ARGS[@]+"${METADATA_ARGS[@]}"}) || exit 1
    if [[ $detected =~ \"provider\":\ \"([a-z]+)\" ]]; then PROVIDER=${BASH_REMATCH[1]}; fi
    if [[ $detected =~ \"preemptible\":\ (true|false) ]]; then SPOT=${BASH_REMATCH[1]}; fi
    if [[ -n $PROVIDER ]]; then
      log "preemption notices: $PROVIDER metadata service${SPOT:+ (spot machine: $SPOT)}, and SIGTERM (grace ${GRACE}s)"
    else
      log "preemption notices: no cloud metadata service answered; SIGTERM only (grace ${GRACE}s)"
    fi ;;
  sigterm) log "preemption notices: SIGTERM only (grace ${GRACE}s)" ;;
esac
if [[ $PREEMPTIBLE == auto ]]; then PREEMPTIBLE=${SPOT:-false}; fi

# ------------------------------------------------------------------ supervision
ENGINE_PID="" AGENT_PID="" HELPER_PID="" WATCH_PID="" NOTICE_PID="" ENDPOINT="" STOP="" STOP_AT="" SIGNALS=0 DONE=0
# Scratch files, deleted as soon as they are open (a SIGKILLed launcher runs no trap, so nothing it
# leaves in $TMPDIR would ever be removed): the registration's stdout on fds 6 (write) and 7 (read);
# the registration state for `box watch` on fds 8 and 9 (helpers reopen them as /dev/fd/N).
scratch=$(mktemp "${TMPDIR:-/tmp}/launch_sglang.XXXXXX")
exec 6>"$scratch" 7<"$scratch"
rm -f "$scratch"
scratch=$(mktemp "${TMPDIR:-/tmp}/launch_sglang.XXXXXX")
exec 8>"$scratch" 9<"$scratch"
rm -f "$scratch"

on_signal() {  # only note it and interrupt what runs; the main flow does the stopping
  SIGNALS=$((SIGNALS + 1))
  [[ -n $STOP ]] || { STOP=$1; STOP_AT=${EPOCHREALTIME/,/.}; }  # bash 5; else the helper counts from its start
  if [[ -n $HELPER_PID ]]; then kill -TERM "$HELPER_PID" 2>/dev/null || true; fi
}
trap 'on_signal SIGINT' INT
trap 'on_signal SIGTERM' TERM
trap 'on_signal SIGHUP' HUP
trap 'finish 1' EXIT  # any unforeseen exit (set -e) still cleans up

# Run a box helper in the background so that a signal is handled at once; returns its exit status.
run_box() {
  "$PY" -m rollout_manager.launch.box "$@" &  # a simple command: $! is python itself, not a subshell
  HELPER_PID=$!
  local rc
  while :; do
    rc=0
    wait "$HELPER_PID" || rc=$?
    kill -0 "$HELPER_PID" 2>/dev/null || break  # else a signal interrupted the wait; the helper is ending
  done
  HELPER_PID=""
  return "$rc"
}

start_child() {  # own process group (Ctrl-C reaches only us) that dies with us; stdin from $CHILD_STDIN
  "$PY" -m rollout_manager.launch.box exec --parent-pid $$ -- "$@" <"${CHILD_STDIN:-/dev/null}" 6>&- 7<&- 8>&- 9<&- &  # not via box(): no subshell
}

# A child leads its own group only once `box exec` has called setpgid (a fraction of a second after the
# start): until then only its pid reaches it. So signal and test both, or a signal that arrives during
# the start finds no group, and a `wait` for the child never returns.
groups_alive() {
  local p
  for p in "$@"; do { kill -0 -- "-$p" || kill -0 "$p"; } 2>/dev/null && return 0; done
  return 1
}

signal_group() {  # signal_group SIG PID: the child's group and the child itself
  kill -"$1" -- "-$2" 2>/dev/null || true
  kill -"$1" "$2" 2>/dev/null || true
}

stop_children() {
  local pids=() p
  for p in "$AGENT_PID" "$ENGINE_PID"; do if [[ -n $p ]]; then pids+=("$p"); fi; done
  (( ${#pids[@]} )) || return 0
  groups_alive "${pids[@]}" || { AGENT_PID="" ENGINE_PID=""; return 0; }
  log "stopping $ENGINE_NAME and the receiver agent"
  for p in "${pids[@]}"; do signal_group TERM "$p"; done
  local deadline=$((SECONDS + STOP_TIMEOUT)) signals=$SIGNALS
  while groups_alive "${pids[@]}" && (( SECONDS < deadline && SIGNALS == signals )); do sleep 0.1; done
  if groups_alive "${pids[@]}"; then
    log "still running after SIGTERM; sending SIGKILL"
    for p in "${pids[@]}"; do signal_group KILL "$p"; done
    while groups_alive "${pids[@]}"; do sleep 0.05; done
  fi
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  AGENT_PID="" ENGINE_PID=""
}

stop_watch() {  # before deregistering: nothing may register the box again, or report a notice
  local p
  for p in "$WATCH_PID" "$NOTICE_PID"; do
    if [[ -n $p ]]; then signal_group TERM "$p"; wait "$p" 2>/dev/null || true; fi
  done
  WATCH_PID="" NOTICE_PID=""
}

# SIGTERM with notices on: the manager is told the box goes in --sigterm-grace-s (counted from the
# signal) and moves its work off; SGLang keeps serving until the manager has removed the box or the time
# is spent. Falls back to deregister when the manager does not take it (one without evacuation).
evacuate_on_sigterm() {
  [[ -n $ENDPOINT && $STOP == SIGTERM && $NOTICE != off ]] && (( SIGNALS == 1 )) || return 1
  log "SIGTERM: reporting $ENDPOINT to the manager as going within ${GRACE}s"
  local rc=0
  run_box evacuate --manager "$MANAGER" --endpoint "$ENDPOINT" --deadline-s "$GRACE" --since "${STOP_AT:-0}" \
    --source sigterm --state-file /dev/fd/9 --wait >/dev/null || rc=$?
  if (( rc == 0 || SIGNALS >= 2 )); then ENDPOINT=""; return 0; fi  # asked twice: stop now
  return 1
}

deregister() {
  [[ -n $ENDPOINT ]] || return 0
  local timeout=$DRAIN_TIMEOUT
  if (( SIGNALS >= 2 )); then
    timeout=2  # asked twice: tell the manager, do not wait for the drain
  else
    log "deregistering $ENDPOINT: the manager drains it (up to ${DRAIN_TIMEOUT}s; a second Ctrl-C skips this)"
  fi
  # with the box token the registration returned (in the state file): it removes this instance only
  if run_box deregister --manager "$MANAGER" --endpoint "$ENDPOINT" --timeout "$timeout" --state-file /dev/fd/9 \
      >/dev/null; then
    log "deregistered $ENDPOINT"
  fi
  ENDPOINT=""
}

finish() {  # deregister, stop the children, exit with $1
  local status=$1
  trap - EXIT
  if (( ! DONE )); then
    DONE=1
    stop_watch || true
    evacuate_on_sigterm || deregister || true
    stop_children || true
  fi
  exit "$status"
}

stop_if_asked() {
  if [[ -n $STOP ]]; then
    log "$STOP received: shutting down"
    finish 0
  fi
}

REGISTER_BOX=()  # what the manager's placement and scaling signal know the box by
if [[ $PREEMPTIBLE == true ]]; then REGISTER_BOX+=(--preemptible); fi
if [[ -n $PRICE ]]; then REGISTER_BOX+=(--price-per-hour "$PRICE"); fi

if (( WHEN_WANTED )); then  # nothing is started before the manager wants a box of this kind
  if ! run_box wait-wanted --manager "$MANAGER" ${REGISTER_BOX[@]+"${REGISTER_BOX[@]}"} --interval "$RECHECK"; then
    stop_if_asked
    finish 1
  fi
  stop_if_asked
fi

start_child "${AGENT_CMD[@]}"
AGENT_PID=$!
start_child "${ENGINE_CMD[@]}"
ENGINE_PID=$!
log "started $ENGINE_NAME (pid $ENGINE_PID, $ENGINE_URL) and the receiver agent (pid $AGENT_PID, $AGENT_URL); waiting up to ${READY_TIMEOUT}s for both"

if ! run_box wait-ready --url "$ENGINE_URL/health" --auth-url "$AGENT_URL/info" \
      --pid "$ENGINE_PID" --pid-name "$ENGINE_NAME" --pid "$AGENT_PID" --pid-name "receiver agent" \
      --timeout "$READY_TIMEOUT"; then
  stop_if_asked
  finish 1
fi
stop_if_asked

REGISTER_MODEL=()  # the CPU engine reports its own vocabulary size; SGLang's is read from the model
if [[ $ENGINE == sglang ]]; then REGISTER_MODEL=(--model-path "$MODEL_PATH"); fi
if [[ -n $VOCAB_SIZE ]]; then REGISTER_MODEL+=(--vocab-size "$VOCAB_SIZE"); fi
if ! run_box register --manager "$MANAGER" --host "$HOST" --port "$PORT" --agent-url "$AGENT_URL" \
      --agent-port "$AGENT_PORT" ${REGISTER_MODEL[@]+"${REGISTER_MODEL[@]}"} ${REGISTER_BOX[@]+"${REGISTER_BOX[@]}"} \
  --state-file /dev/fd/8 >&6; then
  if [[ -n $STOP ]]; then  # interrupted: the manager may have filed us before the helper was stopped
    if [[ $HOST == *:* ]]; then ENDPOINT="[$HOST]:$PORT"; else ENDPOINT="$HOST:$PORT"; fi
  fi
  stop_if_asked
  finish 1
fi
read -r REGISTRATION <&7 || true
if [[ $REGISTRATION =~ \"endpoint\":\"([^\"]+)\" ]]; then ENDPOINT=${BASH_REMATCH[1]}
elif [[ $HOST == *:* ]]; then ENDPOINT="[$HOST]:$PORT"; else ENDPOINT="$HOST:$PORT"; fi
log "registered $ENDPOINT with $MANAGER: $REGISTRATION"
stop_if_asked
# Registers the box again when the manager restarts (rollout_manager/launch/box.py, `watch`).
CHILD_STDIN=/dev/fd/9 start_child "$PY" -m rollout_manager.launch.box watch --manager "$MANAGER" --state-file /dev/stdin \
  --interval "$RECHECK"
WATCH_PID=$!
if [[ -n $PROVIDER ]]; then  # reports this cloud's preemption notices (rollout_manager/launch/notice_watch.py)
  CHILD_STDIN=/dev/fd/9 start_child "$PY" -m rollout_manager.launch.box notice-watch --provider "$PROVIDER" \
    --manager "$MANAGER" --state-file /dev/stdin ${METADATA_ARGS[@]+"${METADATA_ARGS[@]}"}
  NOTICE_PID=$!
fi

while :; do
  # Poll instead of `wait -n`: a child that died before this loop began (a race under load) would
  # otherwise go unseen. `wait` on the sleep returns at once when a signal arrives.
  sleep 0.5 & wait $! 2>/dev/null || true
  stop_if_asked
  for pair in "$ENGINE_PID:$ENGINE_NAME" "$AGENT_PID:receiver agent"; do
    if ! kill -0 "${pair%%:*}" 2>/dev/null; then
      rc=0
      wait "${pair%%:*}" 2>/dev/null || rc=$?
      log "${pair#*:} exited (status $rc) while serving; shutting down"
      finish 3
    fi
  done
done
