# Sourced by the GPU scripts (gpu_suite.sh, gpu_lanes.sh), from the repository root: run from the
# source tree.  grammar/ and templates/ ship as purlinc.grammar / purlinc.templates in a wheel
# (pyproject's package-dir); link them into purlinc/ for the run and remove, at the script's
# exit, only the links this script made (a link made by a caller stays for the caller to remove).
LINKS=()
for pkg in grammar templates; do
  if [ ! -e "purlinc/$pkg" ]; then ln -s "../$pkg" "purlinc/$pkg" && LINKS+=("purlinc/$pkg"); fi
done
trap 'for l in "${LINKS[@]}"; do rm -f "$l"; done' EXIT
