#!/usr/bin/env bash
# Install the Debian packages that the full test run uses, when they are missing and apt is usable.
# chromium: browser tests and Plotly PNG export; dataset-fashion-mnist: the second demo zoo.
set -u
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
ls /usr/share/datasets*/fashion-mnist* >/dev/null 2>&1 || dpkg -s dataset-fashion-mnist >/dev/null 2>&1 || need+=(dataset-fashion-mnist)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian packages: ${need[*]}"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null) \
    || echo "warning: could not install ${need[*]}; the tests that need them will be skipped"
else
  echo "note: ${need[*]} missing (install with: sudo apt-get install ${need[*]}); the tests that need them will be skipped"
fi
exit 0
