#!/usr/bin/env bash
# A text corpus from what a Debian system ships, for training runs longer than one licence text holds
# (the FP8-against-bf16 loss curves of docs/fp8-training.md): every distinct /usr/share/doc/*/copyright file,
# then the packages' Debian changelogs, in path order, up to MB megabytes. The result depends on the packages
# installed; the sha256 printed at the end names it.
#   scripts/debian_corpus.sh OUT.txt [MB=32]
#   flashlm prepare OUT.txt --out data/debian --tokenizer bpe --vocab-size 8192
set -euo pipefail
out=${1:?usage: debian_corpus.sh OUT.txt [MB]}
mb=${2:-32}
limit=$((mb * 1024 * 1024))
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
# Distinct copyright texts (many packages ship the same file), by content.
find /usr/share/doc -name copyright -type f -print0 | sort -z | xargs -0 sha256sum |
  sort -s -k1,1 -u | sort -k2 | cut -c67- | while IFS= read -r f; do cat "$f"; echo; done > "$tmp"
find /usr/share/doc -name 'changelog.Debian.gz' -type f -print0 | sort -z |
  while IFS= read -r -d '' f; do zcat "$f" 2>/dev/null || true; echo; done >> "$tmp"
head -c "$limit" "$tmp" > "$out"
echo "$out: $(wc -c < "$out") bytes, $(ls /usr/share/doc | wc -l) packages' docs, sha256 $(sha256sum "$out" | cut -c1-16)" >&2
