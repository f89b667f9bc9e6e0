#!/bin/bash
# rankwatch Slurm prolog: start one rankwatch agent for the job on this node.
#
# slurm.conf:   Prolog=/etc/slurm/rankwatch/prolog.sh
#               Epilog=/etc/slurm/rankwatch/epilog.sh
#               PrologFlags=Alloc      # run on every node at allocation, before any step
#
# The agent runs as the job's user (its socket is mode 0600, so the job's ranks
# can reach it), in a session of its own, and listens on
#     $RUN_DIR/<job id>/agent.sock          (the job sets RANKWATCH_AGENT to it)
# Its pid goes to $RUN_DIR/<job id>.pid (root's), its incidents and log to
#     $STATE_DIR/<job id>/<node>/           (kept after the job by the epilog)
# and one line per action to $LOG_FILE.  With COORDINATOR_PORT set, the agents of
# a multi-node job elect a coordinator among the job's first nodes, or, with
# ETCD_ENDPOINTS too, through etcd, so that no node's loss leaves the job without one
# (below).
#
# Safe to run twice: an agent already up for the job is left alone.  It never
# fails the job: whatever goes wrong is logged and the prolog exits 0 (a failing
# prolog would drain the node), and `rankwatch run` starts a local agent when it
# finds none.
#
# Settings are shell variables read from $RANKWATCH_SLURM_CONFIG, by default
# /etc/default/rankwatch-slurm; slurmd gives prologs no PATH, so name the
# rankwatch executable there unless it is on the standard PATH below.
set -u
umask 022
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

RANKWATCH=rankwatch                    # the rankwatch executable
RUN_DIR=/run/rankwatch                 # sockets and pidfiles
STATE_DIR=/var/lib/rankwatch/slurm     # incidents and agent logs, kept after the job
LOG_FILE=/var/log/rankwatch/slurm.log  # what the prolog and epilog did
METRICS_PORT=9478                      # 0 on nodes shared by several jobs (a free port each)
AGENT_ARGS=""                          # more `rankwatch agent` flags, e.g. "--hang-floor 10"
COORDINATOR_PORT=""                    # set (e.g. 9479) to coordinate the job across its nodes
COORDINATOR_CANDIDATES=2               # the job's first N nodes may coordinate, in that order
ETCD_ENDPOINTS=""                      # host:port[,host:port...]: elect the coordinator in etcd
TOKEN_KEY_FILE=/etc/rankwatch/slurm-token.key  # root's, 0600, the same on every node: per-job tokens
TLS_CA_DIR=/etc/rankwatch/slurm-ca      # `rankwatch certs init` made it (ca.crt, ca.key): per-job
                                         # certificates for mutual TLS; may be shared storage
TLS_DAYS=30                              # how long a job's certificates are valid
START_TIMEOUT=20                       # seconds to wait for the agent's socket
config=${RANKWATCH_SLURM_CONFIG:-/etc/default/rankwatch-slurm}
# shellcheck source=/dev/null
[ -r "$config" ] && . "$config"

job=${SLURM_JOB_ID:-}
node=${SLURMD_NODENAME:-$(hostname -s)}
uid=${SLURM_JOB_UID:-}
gid=${SLURM_JOB_GID:-}

log() {
    mkdir -p "$(dirname "$LOG_FILE")" 2>/dev/null
    printf '%s prolog job=%s node=%s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$job" "$node" "$*" \
        >>"$LOG_FILE" 2>/dev/null
    return 0
}

case "$job" in ''|*[!0-9]*) log "error: SLURM_JOB_ID '$job' is not a job id"; exit 0 ;; esac
case "$uid" in ''|*[!0-9]*) log "error: SLURM_JOB_UID '$uid' is not a uid"; exit 0 ;; esac
[ -n "$gid" ] || gid=$(id -g "$uid" 2>/dev/null) || { log "error: no group for uid $uid"; exit 0; }

sock_dir=$RUN_DIR/$job
sock=$sock_dir/agent.sock
pidfile=$RUN_DIR/$job.pid
state=$STATE_DIR/$job/$node

# The pid is this job's agent: the job user's `rankwatch agent` on this socket.
is_job_agent() {
    local pid=$1 cmdline
    [ -r "/proc/$pid/cmdline" ] || return 1
    [ "$(stat -c %u "/proc/$pid")" = "$uid" ] || return 1
    cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline")
    case "$cmdline" in *" agent "*"--listen $sock "*) return 0 ;; esac
    return 1
}

if [ -r "$pidfile" ]; then
    pid=$(cat "$pidfile")
    if [ -n "$pid" ] && is_job_agent "$pid"; then
        log "agent already running (pid $pid)"
        exit 0
    fi
    log "removing stale pidfile (pid ${pid:-none} is not this job's agent)"
    rm -f "$pidfile"
fi

# Across nodes: the job's first nodes (Slurm's order, the same on every node) are
# the coordinator candidates; each listens on TCP too, and the first that answers
# coordinates.  With TOKEN_KEY_FILE, the calls between them carry the job's token.
coordination=()
token=""
tls=""
TLS_CA_CERT=$TLS_CA_DIR/ca.crt
TLS_CA_KEY=$TLS_CA_DIR/ca.key   # root's, 0600
if [ -n "$COORDINATOR_PORT" ]; then
    case "$COORDINATOR_PORT$COORDINATOR_CANDIDATES" in
        *[!0-9]*) log "error: COORDINATOR_PORT/COORDINATOR_CANDIDATES must be numbers"; exit 0 ;;
    esac
    if [ -n "$ETCD_ENDPOINTS" ]; then
        # Every node may coordinate: the seat is an etcd key with a TTL (rankwatch agent --election).
        case "$ETCD_ENDPOINTS" in
            *[!A-Za-z0-9.:,_-]*) log "error: ETCD_ENDPOINTS must be host:port[,host:port...]"; exit 0 ;;
        esac
        candidates=("any node, elected in etcd $ETCD_ENDPOINTS")
        coordination+=(--election "etcd://$ETCD_ENDPOINTS" --job-id "$job" --listen "$node:$COORDINATOR_PORT")
    else
        mapfile -t candidates < <(scontrol show hostnames "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-$node}}" \
            2>/dev/null | head -n "$COORDINATOR_CANDIDATES")
        [ "${#candidates[@]}" -gt 0 ] || { log "warning: cannot list the job's nodes; coordinating this node alone"; candidates=("$node"); }
        for candidate in "${candidates[@]}"; do
            coordination+=(--coordinator "$candidate:$COORDINATOR_PORT")
            [ "$candidate" = "$node" ] && coordination+=(--listen "$candidate:$COORDINATOR_PORT")
        done
    fi
    # The job's size: a big job's agents spread their first syncs by it (rankwatch agent --job-nodes).
    job_nodes=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-$node}}" 2>/dev/null | wc -l)
    if [ "${job_nodes:-0}" -gt 1 ]; then coordination+=(--job-nodes "$job_nodes"); fi
    if [ ! -e "$TOKEN_KEY_FILE" ]; then
        log "warning: no $TOKEN_KEY_FILE: port $COORDINATOR_PORT takes unauthenticated calls"
    elif [ ! -s "$TOKEN_KEY_FILE" ] || [ "$(stat -c %u "$TOKEN_KEY_FILE")" != 0 ] \
        || [ $((8#$(stat -c %a "$TOKEN_KEY_FILE") & 8#077)) -ne 0 ]; then
        log "error: $TOKEN_KEY_FILE must be root's, mode 0600 and not empty; not starting the agent"
        exit 0
    else
        # The same on every node of the job, for this job only; never on a command line.
        token=$({ cat "$TOKEN_KEY_FILE"; printf ':%s' "$job"; } | sha256sum | cut -d ' ' -f 1)
        coordination+=(--token-file "$sock_dir/token")
    fi
    if [ ! -e "$TLS_CA_KEY" ]; then
        log "warning: no $TLS_CA_KEY: port $COORDINATOR_PORT takes plaintext calls"
    elif [ ! -s "$TLS_CA_KEY" ] || [ "$(stat -c %u "$TLS_CA_KEY")" != 0 ] \
        || [ $((8#$(stat -c %a "$TLS_CA_KEY") & 8#077)) -ne 0 ] || [ ! -r "$TLS_CA_CERT" ]; then
        log "error: $TLS_CA_KEY must be root's, mode 0600 and not empty, beside $TLS_CA_CERT; not starting the agent"
        exit 0
    else
        tls=1
        coordination+=(--tls-cert "$sock_dir/tls.crt" --tls-key "$sock_dir/tls.key" --tls-ca "$sock_dir/ca.crt")
    fi
fi

# Root owns $RUN_DIR and the pidfile; the user owns only the socket's directory
# and the state directory, which root never writes into.
if ! install -d -m 0755 "$RUN_DIR" "$STATE_DIR/$job" \
    || ! install -d -m 0700 -o "$uid" -g "$gid" "$sock_dir" \
    || ! install -d -m 0750 -o "$uid" -g "$gid" "$state"; then
    log "error: cannot create $sock_dir or $state"
    exit 0
fi
rm -f "$sock"
# Written as the job's user (readable by it alone), like everything in its directories.
# shellcheck disable=SC2016
if [ -n "$token" ] && ! printf '%s\n' "$token" | setpriv --reuid="$uid" --regid="$gid" --init-groups -- \
        /bin/sh -c 'umask 077 && cat >"$1"' rankwatch-token "$sock_dir/token"; then
    log "error: cannot write the job's token to $sock_dir/token"
    exit 0
fi

# Mutual TLS: a key and a certificate for this job on this node, issued by `rankwatch certs
# issue` with the root-only CA key: it names the node (its --node-id, which it may sync for
# alone) and its DNS name, and is handed to the job's user like the token.
as_user_write() {
    # shellcheck disable=SC2016
    setpriv --reuid="$uid" --regid="$gid" --init-groups -- /bin/sh -c 'umask 077 && cat >"$1"' rankwatch-tls "$1"
}
if [ -n "$tls" ]; then
    work=$(mktemp -d) || { log "error: no temporary directory for the job's certificate"; exit 0; }
    if ! issued=$("$RANKWATCH" certs issue "$TLS_CA_DIR" --node "$node" --out "$work" --dns "$node" \
            --days "$TLS_DAYS" 2>&1) \
        || ! as_user_write "$sock_dir/tls.key" <"$work/$node.key" \
        || ! as_user_write "$sock_dir/tls.crt" <"$work/$node.crt" \
        || ! as_user_write "$sock_dir/ca.crt" <"$TLS_CA_CERT"; then
        rm -rf "$work"
        log "error: cannot make the job's TLS certificate in $sock_dir: $(printf '%s' "${issued:-}" | tail -n 2 | tr '\n' ' ')"
        exit 0
    fi
    rm -rf "$work"
fi

# setsid detaches the agent from slurmd; setpriv drops to the job's user before
# the agent's log is opened, so root never writes through a user's symlink.
# AGENT_ARGS is split into words on purpose.
# shellcheck disable=SC2086
(cd "$state" && exec setsid setpriv --reuid="$uid" --regid="$gid" --init-groups -- \
    /bin/sh -c 'exec "$@" >>agent.log 2>&1' rankwatch-agent \
    "$RANKWATCH" agent --listen "$sock" --node-id "$node" --state-dir "$state" \
    --metrics-port "$METRICS_PORT" "${coordination[@]}" $AGENT_ARGS) </dev/null >/dev/null 2>&1 &
pid=$!

deadline=$((SECONDS + START_TIMEOUT))
until [ -S "$sock" ]; do
    if ! kill -0 "$pid" 2>/dev/null; then
        log "error: agent exited at start; $state/agent.log: $(tail -n 3 "$state/agent.log" 2>/dev/null | tr '\n' ' ')"
        exit 0
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        log "error: agent gave no socket within ${START_TIMEOUT}s; stopping it (pid $pid)"
        kill -KILL "$pid" 2>/dev/null
        exit 0
    fi
    sleep 0.2
done
echo "$pid" >"$pidfile"
log "agent started (pid $pid) on $sock${COORDINATOR_PORT:+, coordinators ${candidates[*]} on port $COORDINATOR_PORT}, state in $state"
exit 0
