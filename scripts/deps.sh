#!/usr/bin/env bash
# Installs what kvsource's tests and demo need on a Debian machine, only when it
# is missing: libzmq (cgo, for events and transfer), and Debian's python3-zmq and
# python3-msgpack (for the interop tests against ../shared/interop).
set -euo pipefail

need=()
dpkg -s libzmq3-dev >/dev/null 2>&1 || need+=(libzmq3-dev)
dpkg -s pkg-config >/dev/null 2>&1 || need+=(pkg-config)
/usr/bin/python3 -c 'import zmq' >/dev/null 2>&1 || need+=(python3-zmq)
/usr/bin/python3 -c 'import msgpack' >/dev/null 2>&1 || need+=(python3-msgpack)

if [ ${#need[@]} -gt 0 ]; then
  echo "deps: installing ${need[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq "${need[@]}"
fi

go mod download
