#!/usr/bin/env bash
# Installs what kvsource's tests and demo need on a Debian machine, only when it
# is missing: libzmq (cgo, for events and transfer), and Debian's python3-zmq and
# python3-msgpack (for the interop tests against testdata/interop).
set -euo pipefail

need=()
dpkg -s libzmq3-dev >/dev/null 2>&1 || need+=(libzmq3-dev)
dpkg -s pkg-config >/dev/null 2>&1 || need+=(pkg-config)
/usr/bin/python3 -c 'import zmq' >/dev/null 2>&1 || need+=(python3-zmq)
/usr/bin/python3 -c 'import msgpack' >/dev/null 2>&1 || need+=(python3-msgpack)

# apt runs one at a time: another one (unattended-upgrades on a fresh
# machine, a second make) holds the dpkg and lists locks, and apt-get fails at
# once with "Could not get lock". Wait for it instead, up to 10 minutes.
apt_get() {
  local tries=0
  until $sudo apt-get -o DPkg::Lock::Timeout=60 "$@"; do
    tries=$((tries + 1))
    if [ $tries -ge 10 ]; then
      echo "deps: apt-get $* still failing after $tries tries" >&2
      return 1
    fi
    echo "deps: apt-get $1 failed (another apt run holding its lock?); trying again in 5 s" >&2
    sleep 5
  done
}

if [ ${#need[@]} -gt 0 ]; then
  echo "deps: installing ${need[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  apt_get update -qq
  apt_get install -y -qq "${need[@]}"
fi

go mod download
