# shellcheck shell=bash disable=SC2034  # (sets UV, INSTALL, UNINSTALL for the caller)
# Sourced by the set-up scripts (not run): uv, the installer they share, pointed at one venv. uv resolves and unpacks
# these sets several times faster than pip. It reads neither pip's find-links nor its extra indexes, so they are
# passed on; every install runs under the constraint torch==<the CPU build>.
#
#   uv_for VENV TORCH_VERSION   sets UV (the uv command), INSTALL (uv pip install into VENV, constrained) and
#                               UNINSTALL (uv pip uninstall from VENV); needs the caller's `run`
uv_for() {
  local venv=$1 torch_version=$2 src=() d u
  if command -v uv >/dev/null 2>&1; then
    UV=(uv)
  else
    run "$venv/bin/python" -m pip install -q uv
    UV=("$venv/bin/python" -m uv)
  fi
  echo "torch==$torch_version" > "$venv/oar-constraints.txt"
  for d in ${PIP_FIND_LINKS:-}; do src+=(--find-links "$d"); done
  for u in ${PIP_EXTRA_INDEX_URL:-}; do src+=(--extra-index-url "$u"); done
  # --compile-bytecode: as pip does; without it every fresh process (Ray workers, vLLM engines) compiles the imports
  INSTALL=("${UV[@]}" pip install --python "$venv/bin/python" -c "$venv/oar-constraints.txt"
           --index-strategy unsafe-best-match --compile-bytecode "${src[@]}")
  UNINSTALL=("${UV[@]}" pip uninstall --python "$venv/bin/python")
}
