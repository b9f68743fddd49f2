#!/usr/bin/env bash
# Makes a private CA and a certificate for each Tandem process, named for its role and Service
# (first DNS name and CN: coordinator, target-node, draft-node), and writes them as the Secrets
# components/mtls mounts. Machines have roles: only the coordinator's certificate may act as a
# client (server and client auth: it serves the public gRPC API and dials both nodes); the
# nodes' are server auth only (they dial no one), so a node's certificate, however it leaks,
# opens no connection to another node. The nodes admit the coordinator by name too
# (--allow-client, default coordinator).
#
#   make-certs.sh DIR                 writes DIR/ca.{crt,key} and DIR/NAME/{ca.crt,tls.crt,tls.key}
#   make-certs.sh DIR | kubectl apply -f -    ... and prints the three Secrets as YAML
#
# NAMESPACE (default tandem) names the namespace in the DNS names and the Secrets; DAYS (default
# 365) the validity. Keep DIR/ca.key offline: it signs certificates every node will trust. Rerun
# with the same DIR to renew the leaf certificates under the same CA.
set -euo pipefail
dir=${1:?usage: make-certs.sh DIR}
ns=${NAMESPACE:-tandem}
days=${DAYS:-365}
mkdir -p "$dir"
umask 077
if [ ! -f "$dir/ca.key" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days $((days * 5)) \
    -subj "/CN=tandem-ca" -keyout "$dir/ca.key" -out "$dir/ca.crt" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    2>/dev/null
fi
for name in coordinator target-node draft-node; do
  usage=serverAuth
  [ "$name" = coordinator ] && usage=serverAuth,clientAuth
  out="$dir/$name"
  mkdir -p "$out"
  cp "$dir/ca.crt" "$out/ca.crt"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$name" \
    -keyout "$out/tls.key" -out "$out/tls.csr" 2>/dev/null
  printf '%s\n' \
    "subjectAltName=DNS:$name,DNS:$name.$ns,DNS:$name.$ns.svc,DNS:$name.$ns.svc.cluster.local" \
    "extendedKeyUsage=$usage" "keyUsage=critical,digitalSignature" \
    "basicConstraints=CA:FALSE" >"$out/ext.cnf"
  openssl x509 -req -in "$out/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
    -days "$days" -extfile "$out/ext.cnf" -out "$out/tls.crt" 2>/dev/null
  rm "$out/tls.csr" "$out/ext.cnf"
  if [ ! -t 1 ]; then
    printf -- '---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: tandem-tls-%s\n  namespace: %s\ntype: Opaque\ndata:\n' "$name" "$ns"
    for f in ca.crt tls.crt tls.key; do
      printf '  %s: %s\n' "$f" "$(base64 -w0 <"$out/$f")"
    done
  fi
done
echo "certificates in $dir (CA key: $dir/ca.key)" >&2
