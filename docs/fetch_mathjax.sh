#!/usr/bin/env bash
# MathJax 3 for the site, served from its own _static/ so that math renders without a network
# (docs/conf.py uses build/mathjax/tex-chtml.js when it is there, else Sphinx's CDN address).
# From the npm registry once (`npm pack`, 6 MB), then kept in build/mathjax (1.6 MB: the one
# script the site loads and its web fonts).
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/mathjax
[ -f "$out/tex-chtml.js" ] && exit 0
if ! command -v npm >/dev/null; then
  echo "docs: npm not found; the site loads MathJax from its CDN (math needs a network to render)" >&2
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && npm pack --silent mathjax@3.2.2 >/dev/null 2>&1 && tar xzf mathjax-3.2.2.tgz); then
  echo "docs: npm pack mathjax@3.2.2 failed (no registry?); the site loads MathJax from its CDN" >&2
  exit 0
fi
mkdir -p "$out/output/chtml/fonts"
cp "$tmp/package/es5/tex-chtml.js" "$out/"
cp -r "$tmp/package/es5/output/chtml/fonts/woff-v2" "$out/output/chtml/fonts/"
echo "docs: MathJax 3.2.2 in $out"
