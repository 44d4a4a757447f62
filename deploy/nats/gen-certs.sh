#!/bin/sh
# gen-certs.sh DIR [HOST...]: a CA, a server certificate (for HOST..., 127.0.0.1 and localhost) and a client
# certificate for NATS with TLS, using openssl. Files: ca.pem ca-key.pem server.pem server-key.pem
# client.pem client-key.pem. Keep ca-key.pem offline; give each host only what it needs (servers: server*,
# ca.pem; agents and CLI: client*, ca.pem). Use your own PKI when you have one.
set -eu
dir=${1:?usage: gen-certs.sh DIR [HOST...]}
shift
days=${DAYS:-365}
mkdir -p "$dir"
umask 077
cd "$dir"
san="IP:127.0.0.1,DNS:localhost"
for h in "$@"; do
	case "$h" in
	*[!0-9.]*) san="$san,DNS:$h" ;;
	*) san="$san,IP:$h" ;;
	esac
done
openssl ecparam -name prime256v1 -genkey -noout -out ca-key.pem
openssl req -x509 -new -key ca-key.pem -sha256 -days "$days" -subj "/CN=imagefleet CA" \
	-addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" -out ca.pem
leaf() { # name cn extendedKeyUsage [san]
	openssl ecparam -name prime256v1 -genkey -noout -out "$1-key.pem"
	openssl req -new -key "$1-key.pem" -subj "/CN=$2" -out "$1.csr"
	{
		echo "basicConstraints=CA:FALSE"
		echo "keyUsage=critical,digitalSignature"
		echo "extendedKeyUsage=$3"
		[ -n "${4:-}" ] && echo "subjectAltName=$4"
	} > "$1.ext"
	openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days "$days" -sha256 \
		-extfile "$1.ext" -out "$1.pem" 2>/dev/null
	rm -f "$1.csr" "$1.ext"
}
# The server certificate is also a client one: a cluster server dials its peers with it (route mTLS).
leaf server imagefleet-nats serverAuth,clientAuth "$san"
leaf client imagefleet-client clientAuth
rm -f ca.srl
chmod 644 ca.pem server.pem client.pem
echo "wrote $(pwd): ca.pem server.pem server-key.pem client.pem client-key.pem (ca-key.pem: keep offline)"
