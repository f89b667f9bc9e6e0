#!/bin/bash
# rankwatch Slurm epilog: stop the job's rankwatch agent on this node, keep its evidence.
#
# slurm.conf:   Epilog=/etc/slurm/rankwatch/epilog.sh   (with prolog.sh as Prolog)
#
# Before stopping the agent it saves the agent's final view (`rankwatch status
# --json`: ranks and incidents) as status.json beside the incidents the agent
# appended to incidents.jsonl and its agent.log, all in
#     $STATE_DIR/<job id>/<node>/
# which is kept; prune it as you would job logs.  The socket directory and the
# pidfile go.  Safe when no agent runs (the prolog failed, or ran twice), and
# never fails: a failing epilog would drain the node.
#
# Settings: the same file as the prolog's ($RANKWATCH_SLURM_CONFIG, by default
# /etc/default/rankwatch-slurm).
set -u
umask 022
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

RANKWATCH=rankwatch
RUN_DIR=/run/rankwatch
STATE_DIR=/var/lib/rankwatch/slurm
LOG_FILE=/var/log/rankwatch/slurm.log
STOP_TIMEOUT=10                        # seconds between SIGTERM and SIGKILL
config=${RANKWATCH_SLURM_CONFIG:-/etc/default/rankwatch-slurm}
# shellcheck source=/dev/null
[ -r "$config" ] && . "$config"

job=${SLURM_JOB_ID:-}
node=${SLURMD_NODENAME:-$(hostname -s)}
uid=${SLURM_JOB_UID:-}
gid=${SLURM_JOB_GID:-}

log() {
    mkdir -p "$(dirname "$LOG_FILE")" 2>/dev/null
    printf '%s epilog job=%s node=%s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$job" "$node" "$*" \
        >>"$LOG_FILE" 2>/dev/null
    return 0
}

case "$job" in ''|*[!0-9]*) log "error: SLURM_JOB_ID '$job' is not a job id"; exit 0 ;; esac
case "$uid" in ''|*[!0-9]*) log "error: SLURM_JOB_UID '$uid' is not a uid"; exit 0 ;; esac
[ -n "$gid" ] || gid=$(id -g "$uid" 2>/dev/null) || gid=$uid

sock_dir=$RUN_DIR/$job
sock=$sock_dir/agent.sock
pidfile=$RUN_DIR/$job.pid
state=$STATE_DIR/$job/$node

# The pid is this job's agent, alive: the job user's `rankwatch agent` on this
# socket.  A zombie has an empty cmdline, so it counts as gone.
is_job_agent() {
    local pid=$1 cmdline
    [ -r "/proc/$pid/cmdline" ] || return 1
    [ "$(stat -c %u "/proc/$pid")" = "$uid" ] || return 1
    cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline")
    case "$cmdline" in *" agent "*"--listen $sock "*) return 0 ;; esac
    return 1
}

pid=""
[ -r "$pidfile" ] && pid=$(cat "$pidfile")
if [ -z "$pid" ]; then
    log "no agent recorded for the job"
elif ! is_job_agent "$pid"; then
    log "agent (pid $pid) already gone"
else
    # The snapshot is written as the job's user, into the user's directory.
    if ! (cd "$state" && exec timeout 10 setpriv --reuid="$uid" --regid="$gid" --init-groups -- \
            /bin/sh -c 'exec "$@" >status.json 2>>agent.log' rankwatch-status \
            "$RANKWATCH" status --json --agent "$sock") </dev/null >/dev/null 2>&1; then
        log "warning: could not save the agent's final status to $state/status.json"
    fi
    kill -TERM "$pid" 2>/dev/null
    deadline=$((SECONDS + STOP_TIMEOUT))
    while is_job_agent "$pid" && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 0.2
    done
    if is_job_agent "$pid"; then
        log "agent (pid $pid) ignored SIGTERM for ${STOP_TIMEOUT}s; killing it"
        kill -KILL "$pid" 2>/dev/null
    fi
    log "agent stopped (pid $pid); incidents and logs kept in $state"
fi
rm -f "$pidfile"
rm -rf "$sock_dir"
exit 0
