#!/usr/bin/env bash
# A real one-node SLURM cluster on loopback, and the tiny DAG run through it with
# `snakemake --profile workflow/profiles/slurm`. Needs root and Debian/Ubuntu apt (or
# slurm-wlm + munge already installed); tests/test_slurm_cluster.py calls it.
#
#   workflow/cluster/slurm_local.sh            # up, dag, preempt, down (the whole test)
#   workflow/cluster/slurm_local.sh up|dag|preempt|down
#
# up       install slurm-wlm + munge (apt, retried while another apt holds the lock), write
#          /etc/slurm/slurm.conf (slurmctld + slurmd on 127.0.0.1, proctrack/linuxproc and
#          task/none: no cgroups; no accounting database: JobCompType=jobcomp/filetxt, read
#          by `sacct -c`), start a private munged, slurmctld and slurmd, run a probe job.
# dag      copy the working tree twice (tracked + untracked, not ignored), run the tiny DAG
#          with the local profile in one and the SLURM profile in the other; check that every
#          job went through sbatch and completed (sacct -c), that each job got the threads,
#          memory and time limit its rule declared, and that the outputs are the same.
# preempt  a tiny warmup training job under sbatch, cancelled mid-run (SLURM sends SIGTERM,
#          then SIGKILL after KillWait, as for a preemption or a time limit), resubmitted:
#          it resumes from its checkpoint and ends with the same model.bin as the DAG's run.
# down     stop the daemons this script started (by their pid files), remove its slurm.conf.
#
# Exit: 0 passed; 1 failed; 77 cannot run here (the reason is the line starting "SKIP:").
# State: $ANDREA_SLURM_STATE (default /tmp/andrea-slurm). Cores: $ANDREA_SLURM_CORES (nproc).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STATE=${ANDREA_SLURM_STATE:-/tmp/andrea-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by andrea workflow/cluster/slurm_local.sh"
CORES=${ANDREA_SLURM_CORES:-$(nproc)}
NODE=$(hostname -s)
PY=${PYTHON:-python3}

say() { echo "[slurm_local $(date -u +%H:%M:%S)] $*"; }
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

# ------------------------------------------------------------------------------ up
install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return 0
  fi
  command -v apt-get >/dev/null || skip "slurm-wlm is not installed and there is no apt-get to install it"
  local t0=$SECONDS i
  for i in $(seq 1 40); do  # another apt/dpkg (e.g. a browser install) may hold the lock for a while
    if apt-get -o DPkg::Lock::Timeout=30 update -q >"$STATE/apt.log" 2>&1 \
       && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=30 install -y -q --no-install-recommends \
          slurm-wlm munge >>"$STATE/apt.log" 2>&1; then
      say "installed slurm-wlm + munge in $((SECONDS - t0)) s"
      return 0
    fi
    grep -q -i "lock" "$STATE/apt.log" || { tail -5 "$STATE/apt.log"; skip "apt-get install slurm-wlm munge failed (no network or no such package; $STATE/apt.log)"; }
    say "apt lock held by another process (try $i), retrying in 15 s"
    sleep 15
  done
  skip "apt lock still held after 40 tries"
}

write_conf() {
  if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    skip "$CONF exists and is not ours: this machine has a SLURM configuration; not touching it"
  fi
  local mem
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))
  mkdir -p /etc/slurm "$STATE"/{ctld,d,log,sock} "$STATE/munge"
  chmod 755 "$STATE" "$STATE/sock"  # munged wants its socket's folders searchable by all ...
  chmod 700 "$STATE/munge"          # ... and its key private
  # /etc/slurm/slurm.conf, not SLURM_CONF: the job step that srun starts inside each sbatch job
  # (snakemake-executor-plugin-slurm-jobstep) drops every SLURM_* variable it does not know.
  cat >"$CONF" <<EOF
$MARK; removed by its "down"
ClusterName=andrea
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/sock/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/jobcomp.txt
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
ReturnToService=2
KillWait=30
MinJobAge=600
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CORES RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

wait_for() {  # wait_for SECONDS COMMAND...: until the command succeeds
  local n=$1; shift
  for _ in $(seq 1 "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done
  return 1
}

alive() { local pid; pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }

up() {
  [ "$(id -u)" = 0 ] || skip "needs root (installs packages, starts slurmctld/slurmd as root), uid is $(id -u)"
  mkdir -p "$STATE"
  install
  down quiet
  write_conf
  rm -f "$STATE/jobcomp.txt"
  [ -s "$STATE/munge/munge.key" ] || mungekey -c -k "$STATE/munge/munge.key" >/dev/null 2>&1 \
    || dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1 count=1024 2>/dev/null
  chmod 600 "$STATE/munge/munge.key"
  munged --key-file="$STATE/munge/munge.key" --socket="$STATE/sock/munge.sock" --pid-file="$STATE/munged.pid" \
    --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/seed" \
    || { tail -3 "$STATE/log/munged.log"; skip "munged did not start: $(tail -1 "$STATE/log/munged.log")"; }
  wait_for 10 sh -c "munge -S '$STATE/sock/munge.sock' -n | unmunge -S '$STATE/sock/munge.sock'" \
    || skip "munge credentials do not round-trip through $STATE/sock/munge.sock"
  slurmctld -f "$CONF" || skip "slurmctld refused to start: $(tail -1 "$STATE/log/slurmctld.log" 2>/dev/null)"
  wait_for 20 scontrol ping || skip "slurmctld is not answering: $(grep -i -E 'error|fatal' "$STATE/log/slurmctld.log" | tail -1)"
  slurmd -f "$CONF" || skip "slurmd refused to start: $(grep -i -E 'error|fatal' "$STATE/log/slurmd.log" | tail -1)"
  if ! wait_for 30 sh -c "sinfo -h -N -o %T | grep -q -E '^idle|^mixed|^allocated'"; then
    sinfo -N -l || true
    skip "slurmd did not register an idle node: $(grep -i -E 'fatal|error' "$STATE/log/slurmd.log" | grep -v -i pmix | tail -1)"
  fi
  local out
  out=$(srun -N1 -n1 -t 1 --mem 50 true 2>&1) \
    || skip "slurmd cannot launch a job step here: ${out:-no message} / $(grep -i -E 'fatal|error' "$STATE/log/slurmd.log" | grep -v -i pmix | tail -1)"
  say "cluster up: node $NODE, $CORES CPUs, $(sinfo -h -o %m) MB; conf $CONF; state $STATE"
}

# ------------------------------------------------------------------------------ down
down() {
  local f
  for f in slurmd slurmctld munged; do
    if alive "$STATE/$f.pid"; then
      kill "$(cat "$STATE/$f.pid" 2>/dev/null)" 2>/dev/null || true
      for _ in $(seq 1 20); do alive "$STATE/$f.pid" || break; sleep 0.5; done
    fi
    rm -f "$STATE/$f.pid"
  done
  if [ -e "$CONF" ] && grep -qF "$MARK" "$CONF"; then rm -f "$CONF"; fi
  [ "${1:-}" = quiet ] || say "cluster down"
}

# ------------------------------------------------------------------------------ dag
copy_tree() {  # the working tree as a clean clone would have it, plus untracked files that are not ignored
  rm -rf "$1" && mkdir -p "$1"
  (cd "$REPO" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$1"
}

dag() {
  local t0 secs_local secs_slurm
  copy_tree "$STATE/local"
  copy_tree "$STATE/cluster"
  t0=$SECONDS
  say "local run: snakemake --profile workflow/profiles/local --cores $CORES"
  (cd "$STATE/local" && PYTHONPATH="$STATE/local" snakemake --profile workflow/profiles/local --cores "$CORES" \
     >"$STATE/local.log" 2>&1) || { tail -30 "$STATE/local.log"; fail "the local run failed ($STATE/local.log)"; }
  secs_local=$((SECONDS - t0))
  t0=$SECONDS
  # --cores: no job may ask for more CPUs than the node has (sbatch would refuse it), and a rule
  # that still says `threads: workflow.cores` needs it defined. squeue for job status: there is
  # no accounting database here, so plain `sacct` (the plugin's default) has nothing to read.
  say "SLURM run: snakemake --profile workflow/profiles/slurm --cores $CORES"
  (cd "$STATE/cluster" && PYTHONPATH="$STATE/cluster" snakemake --profile workflow/profiles/slurm --cores "$CORES" \
     --slurm-status-command squeue --slurm-init-seconds-before-status-checks 5 --slurm-keep-successful-logs \
     >"$STATE/cluster.log" 2>&1) || { tail -40 "$STATE/cluster.log"; fail "the SLURM run failed ($STATE/cluster.log)"; }
  secs_slurm=$((SECONDS - t0))
  say "local run ${secs_local} s, SLURM run ${secs_slurm} s"
  sacct -c -P --format=JobID,JobName,State,ExitCode,NCPUS,Timelimit,Elapsed >"$STATE/sacct.txt"
  "$PY" "$REPO/workflow/cluster/check_run.py" --log "$STATE/cluster.log" --sacct "$STATE/sacct.txt" \
    --jobcomp "$STATE/jobcomp.txt" --local "$STATE/local" --cluster "$STATE/cluster" || fail "checks failed"
}

# ------------------------------------------------------------------------------ preempt
preempt() {
  local run="$STATE/cluster" out="$STATE/preempt" threads job1 job2 step t0 t1
  [ -f "$run/runs/tiny/warmup/model.state.json" ] || fail "run 'dag' first: $run/runs/tiny/warmup is missing"
  rm -rf "$out" && mkdir -p "$out"
  threads=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['batch_slices'])" "$run/runs/tiny/warmup/model.state.json")
  # the DAG's warmup command, into another folder, with the DAG's thread count (the bits depend on it)
  cat >"$out/train.sh" <<EOF
#!/bin/sh
cd "$run"
export PYTHONPATH="$run" OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
exec andrea train --phase warmup --profile tiny --tokenizer data/tokenizer/tiny/tokenizer.json \\
  --tokens data/tokens/tiny --out "$out/warmup"
EOF
  chmod +x "$out/train.sh"
  t0=$SECONDS
  job1=$(sbatch --parsable -J preempt-1 -c "$threads" --mem 1000 -t 10 -o "$out/job1.log" "$out/train.sh")
  say "job $job1: warmup training submitted; cancelling it once it is past step 20"
  for _ in $(seq 1 300); do
    grep -q -E "warmup step ([2-9][0-9]|1[0-9][0-9])/" "$out/job1.log" 2>/dev/null && break
    sleep 1
  done
  grep -q -E "warmup step ([2-9][0-9]|1[0-9][0-9])/" "$out/job1.log" || { cat "$out/job1.log"; fail "job $job1 never reached step 20"; }
  scancel "$job1"   # SLURM: SIGCONT + SIGTERM to every process of the job, SIGKILL after KillWait
  wait_for 60 sh -c "! squeue -h -j $job1 | grep -q ."
  t1=$SECONDS
  step=$("$PY" -c "import json,sys; s=json.load(open(sys.argv[1])); print(s['step'], s['saved_because'])" "$out/warmup/model.state.json") \
    || { cat "$out/job1.log"; fail "no checkpoint after the cancel"; }
  say "job $job1 cancelled after $((t1 - t0)) s; checkpoint: step ${step}"
  case "$step" in *SIGTERM) ;; *) cat "$out/job1.log"; fail "the checkpoint was not written on SIGTERM: $step";; esac
  job2=$(sbatch --parsable -J preempt-2 -c "$threads" --mem 1000 -t 10 -o "$out/job2.log" "$out/train.sh")
  wait_for 600 sh -c "! squeue -h -j $job2 | grep -q ."
  say "job $job2 (resubmitted) ended after $((SECONDS - t1)) s"
  grep -q "resuming warmup at step ${step%% *}" "$out/job2.log" || { cat "$out/job2.log"; fail "job $job2 did not resume at step ${step%% *}"; }
  sacct -c -P --format=JobID,JobName,State,ExitCode,Elapsed -j "$job1,$job2" | tee "$out/sacct.txt"
  grep -q "^$job1|preempt-1|CANCELLED" "$out/sacct.txt" || fail "sacct does not show job $job1 CANCELLED"
  grep -q "^$job2|preempt-2|COMPLETED|0:0" "$out/sacct.txt" || fail "sacct does not show job $job2 COMPLETED"
  if cmp -s "$out/warmup/model.bin" "$run/runs/tiny/warmup/model.bin"; then
    say "preempted + resumed model.bin == the DAG's uninterrupted runs/tiny/warmup/model.bin"
  else
    fail "the resumed run's model.bin differs from the uninterrupted one"
  fi
}

main() {
  case "${1:-all}" in
    up) up ;;
    down) down ;;
    dag) dag ;;
    preempt) preempt ;;
    all)
      exec 9>/tmp/andrea-slurm-local.lock  # one cluster per machine: the ports and /etc/slurm/slurm.conf are shared
      flock -n 9 || skip "another slurm_local.sh holds /tmp/andrea-slurm-local.lock"
      trap 'down' EXIT
      up
      dag
      preempt
      say "PASS"
      ;;
    *) echo "usage: $0 [all|up|dag|preempt|down]" >&2; exit 2 ;;
  esac
}

main "$@"
