# shellcheck shell=bash disable=SC2034  # (sets UV, INSTALL, UNINSTALL for the caller)
# Sourced by the set-up scripts (not run): uv, the installer they share, pointed at one venv. uv resolves and unpacks
# these sets several times faster than pip. It does not read pip's settings: PIP_INDEX_URL, PIP_EXTRA_INDEX_URL and
# PIP_FIND_LINKS are passed on (a pip.conf is not: export them, or uv's own UV_INDEX_URL / uv.toml); every install
# runs under the constraint torch==<the CPU build>.
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
  if [[ -n "${PIP_INDEX_URL:-}" ]]; then src+=(--index-url "$PIP_INDEX_URL"); fi
  for d in ${PIP_FIND_LINKS:-}; do src+=(--find-links "$d"); done
  for u in ${PIP_EXTRA_INDEX_URL:-}; do src+=(--extra-index-url "$u"); done
  # --compile-bytecode: as pip does; without it every fresh process (Ray workers, vLLM engines) compiles the imports
  INSTALL=("${UV[@]}" pip install --python "$venv/bin/python" -c "$venv/oar-constraints.txt"
           --index-strategy unsafe-best-match --compile-bytecode "${src[@]}")
  UNINSTALL=("${UV[@]}" pip uninstall --python "$venv/bin/python")
}
