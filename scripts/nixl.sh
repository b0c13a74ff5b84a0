#!/usr/bin/env bash
# Prints the environment that builds and runs the `nixl`-tagged code against
# the relocatable NIXL + UCX build in ../shared/nixl (see its README.md), as
# shell `export` lines for eval:
#
#   eval "$(scripts/nixl.sh)" && go test -tags nixl -run NIXL ./transfer/...
#
# The tarball is extracted once into a cache outside the checkout, keyed by
# its checksum: ${XDG_CACHE_HOME:-$HOME/.cache}/kvsource/nixl-<sha256[:16]>.
# Nothing of it is ever written into the checkout.
#
# Where the build is: $KVSOURCE_NIXL_DIR if set, else shared/nixl beside this
# checkout (CI puts shared/ beside the clone), else beside the main checkout
# when this one is a git worktree.
#
# Exit status: 0 with the exports on stdout; 2 when no NIXL build is there
# (the caller skips, with the reason on stderr); 1 when one is there but
# cannot be used.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)

find_dir() {
  if [[ -n ${KVSOURCE_NIXL_DIR:-} ]]; then
    echo "$KVSOURCE_NIXL_DIR"
    return
  fi
  local d=$root/../shared/nixl
  if [[ ! -d $d ]]; then
    # A worktree's siblings are other worktrees: look beside the main one.
    local common
    if common=$(git -C "$root" rev-parse --path-format=absolute --git-common-dir 2>/dev/null); then
      d=$(dirname "$common")/../shared/nixl
    fi
  fi
  echo "$d"
}

dir=$(find_dir)
if [[ ! -d $dir ]]; then
  echo "nixl.sh: no NIXL build at $dir (set KVSOURCE_NIXL_DIR, or put shared/ beside the checkout)" >&2
  exit 2
fi
shopt -s nullglob
tars=("$dir"/nixl-*.tar.gz)
if (( ${#tars[@]} != 1 )); then
  echo "nixl.sh: want exactly one nixl-*.tar.gz in $dir, found ${#tars[@]}" >&2
  exit 2
fi
tarball=${tars[0]}

sum=$(sha256sum "$tarball" | cut -c1-16)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/kvsource
prefix=$cache/nixl-$sum
if [[ ! -f $prefix/.complete ]]; then
  mkdir -p "$cache"
  # Extract beside the final place and rename, so a concurrent run or an
  # interrupted one never leaves a half tree that looks complete.
  tmp=$(mktemp -d "$cache/.nixl-$sum.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  tar -xzf "$tarball" -C "$tmp"
  if [[ ! -d $tmp/nixl/include || ! -d $tmp/nixl/lib ]]; then
    echo "nixl.sh: $tarball has no nixl/include and nixl/lib" >&2
    exit 1
  fi
  touch "$tmp/nixl/.complete"
  if ! mv -T "$tmp/nixl" "$prefix" 2>/dev/null && [[ ! -f $prefix/.complete ]]; then
    echo "nixl.sh: cannot move the extracted tree to $prefix" >&2
    exit 1
  fi
fi

lib=$prefix/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
if [[ ! -f $lib/libnixl_capi.so ]]; then
  echo "nixl.sh: no libnixl_capi.so in $lib (a build for another architecture?)" >&2
  exit 1
fi

# CGO_CFLAGS replaces Go's default (-O2 -g) unless that is kept.
printf 'export CGO_CFLAGS=%q\n' "${CGO_CFLAGS:--O2 -g} -I$prefix/include"
printf 'export CGO_LDFLAGS=%q\n' "${CGO_LDFLAGS:+$CGO_LDFLAGS }-L$lib"
printf 'export LD_LIBRARY_PATH=%q\n' "$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
