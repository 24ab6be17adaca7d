#!/usr/bin/env bash
# Writes the kustomization of a namespaced-Secrets install into DIR (config/default with the
# secret-namespaces component and the manager's --secret-namespaces flag) and, into RBAC_FILE, a
# Role and RoleBinding per namespace given that grant capmox's ServiceAccount what it does with
# credentials and bootstrap Secrets there (get; patch to adopt a credentials Secret with a
# finalizer and owner reference). The Roles are a file of their own: clusterctl moves every
# namespaced object of infrastructure-components.yaml into the provider's namespace.
# Usage: generate.sh REPO_ROOT DIR RBAC_FILE NAMESPACE...
set -euo pipefail
root=$1
dir=$2
rbac=$3
shift 3
if [ $# -eq 0 ]; then
  echo "generate.sh: name at least one namespace" >&2
  exit 1
fi
for namespace in "$@"; do
  if ! [[ $namespace =~ ^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$ ]]; then
    echo "generate.sh: $namespace is not a namespace name (a DNS label: a-z, 0-9, -)" >&2
    exit 1
  fi
done
list=$(IFS=,; echo "$*")
mkdir -p "$dir"
# Kustomize takes only relative paths.
root=$(python3 -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' "$root" "$dir")
cat > "$dir/kustomization.yaml" <<YAML
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
labels:
- pairs:
    cluster.x-k8s.io/provider: infrastructure-proxmox
  includeSelectors: false
resources:
- $root/config/default
components:
- $root/config/components/secret-namespaces
patches:
- target:
    kind: Deployment
    name: capmox-controller-manager
  patch: |-
    - op: add
      path: /spec/template/spec/containers/0/args/-
      value: --secret-namespaces=$list
YAML
: > "$rbac"
for namespace in "$@"; do
  cat >> "$rbac" <<YAML
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: capmox-manager-secrets
  namespace: $namespace
  labels:
    cluster.x-k8s.io/provider: infrastructure-proxmox
rules:
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, list, patch, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: capmox-manager-secrets
  namespace: $namespace
  labels:
    cluster.x-k8s.io/provider: infrastructure-proxmox
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: capmox-manager-secrets
subjects:
- kind: ServiceAccount
  name: capmox-manager
  namespace: capmox-system
YAML
done
