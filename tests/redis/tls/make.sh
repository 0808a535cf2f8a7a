#!/usr/bin/env bash
# How the committed test certificates were made (once; the tests need no openssl):
# a CA, a server certificate for IP 127.0.0.1 and DNS localhost, a client certificate,
# a server certificate for another name only (wrong.example), and a second, unrelated
# CA; ECDSA P-256, valid 100 years. Test-only keys: never use them anywhere else.
set -euo pipefail
cd "$(dirname "$0")"
days=36500
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
ca() {  # name subject
  key "$1.key"
  openssl req -x509 -new -key "$1.key" -days $days -subj "$2" -out "$1.pem" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
}
leaf() {  # name subject serial extensions
  key "$1.key"
  openssl req -new -key "$1.key" -subj "$2" -out "$1.csr"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -set_serial "$3" -days $days \
    -extfile <(printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature" $4) \
    -out "$1.pem" 2>/dev/null
  rm "$1.csr"
}
ca ca "/CN=kvrs test CA"
ca other-ca "/CN=kvrs other test CA"
leaf server "/CN=localhost" 2 "extendedKeyUsage=serverAuth,clientAuth subjectAltName=IP:127.0.0.1,DNS:localhost"
leaf client "/CN=kvrs-client" 3 "extendedKeyUsage=clientAuth"
leaf wrong-name "/CN=wrong.example" 4 "extendedKeyUsage=serverAuth subjectAltName=DNS:wrong.example"
rm -f ca.key other-ca.key  # no more certificates are signed with them
