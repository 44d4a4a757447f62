package natsconf

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// RoleCentral is the fleet and the inventory in one process (one ServiceAccount): the union of their
// permissions.
const RoleCentral = "central"

// CentralPermissions are FleetPermissions and InventoryPermissions together, for a process that runs both.
func CentralPermissions(pub string) Permissions {
	f, i := FleetPermissions(pub), InventoryPermissions(pub)
	union := func(a, b []string) []string {
		out := slices.Clone(a)
		for _, s := range b {
			if !slices.Contains(out, s) {
				out = append(out, s)
			}
		}
		return out
	}
	return Permissions{Publish: union(f.Publish, i.Publish), Subscribe: union(f.Subscribe, i.Subscribe), AllowResponses: true}
}

// RolePermissions are the permissions of role (fleet, inventory, central or admin) for the user whose inbox
// is _INBOX.<pub>; the node role needs its node (NodePermissions).
func RolePermissions(role, pub string) (Permissions, error) {
	switch role {
	case RoleFleet:
		return FleetPermissions(pub), nil
	case RoleInventory:
		return InventoryPermissions(pub), nil
	case RoleCentral:
		return CentralPermissions(pub), nil
	case RoleAdmin:
		return AdminPermissions(pub), nil
	}
	return Permissions{}, fmt.Errorf("role %q: want one of %s", role, strings.Join(CalloutRoles, ", "))
}

// CalloutRoles are the roles an auth callout grants to the tokens of a ServiceAccount (RolePermissions).
var CalloutRoles = []string{RoleFleet, RoleInventory, RoleCentral, RoleAdmin}

// Names in the callout-mode config.
const (
	// CalloutAccount holds the auth callout's own user; nothing else runs there.
	CalloutAccount = "AUTH"
	// CalloutUser is the callout's user name (its password: CalloutOptions.PasswordEnv).
	CalloutUser = "callout"
	// DefaultIssuerEnv and DefaultPasswordEnv are the environment variables the config reads the issuer's
	// public key and the callout user's password from.
	DefaultIssuerEnv   = "ISSUER_PUB"
	DefaultPasswordEnv = "CALLOUT_PASSWORD"
)

// CalloutOptions shape a server config in auth callout mode (RenderCallout).
type CalloutOptions struct {
	// Listen is the client listener (default "0.0.0.0:4222").
	Listen string
	// ServerName (default: none, the server picks one). ServerNameEnv, when set instead, names an
	// environment variable holding it (POD_NAME in a StatefulSet): a cluster needs a distinct name per server.
	ServerName, ServerNameEnv string
	// StoreDir is the JetStream store (default: none; the embedded server's --store-dir decides).
	StoreDir string
	// TLS, when set, serves clients over TLS with this certificate and key. The token is the client's
	// identity, so client certificates are not asked for unless VerifyClients.
	TLS           *TLSFiles
	VerifyClients bool
	// Cluster, when set, makes the server one of a cluster (one per replica).
	Cluster *CalloutCluster
	// Hosts are nkey identities for hosts outside Kubernetes (as Generate makes them: a node's seed on its
	// host, with its NodePermissions): users of the account that the server checks itself, listed in
	// auth_users so the callout never sees them.
	Hosts []Identity
	// IssuerEnv and PasswordEnv name the environment variables holding the issuer's public key (issuer.pub
	// of `imagefleet bus keys`) and the callout user's password (callout.password); defaults
	// DefaultIssuerEnv and DefaultPasswordEnv. Secrets stay out of the file: the server reads them at start.
	IssuerEnv, PasswordEnv string
}

// CalloutCluster is the cluster block of a callout-mode server.
type CalloutCluster struct {
	// Name of the cluster (default "imagefleet").
	Name string
	// Listen is the route listener (default "0.0.0.0:6222").
	Listen string
	// Routes are the other servers' route URLs (nats-route://imagefleet-nats-1.imagefleet-nats:6222); a
	// server's own URL among them is harmless.
	Routes []string
	// TLS, when set, runs the routes over mutual TLS with these files (the certificate must be good for
	// client and server use). Without it the route port must be reachable by the servers only.
	TLS *TLSFiles
}

// RenderCallout is a nats-server configuration in auth callout mode: JetStream; account IMAGEFLEET (with
// JetStream) holding no user of its own; account AUTH holding the callout's user, whose password is read
// from the environment; and the authorization block that sends every other connection to the callout
// (`imagefleet bus auth-callout`), which answers with a user placed in IMAGEFLEET and signed by the issuer
// whose public key is read from the environment.
func RenderCallout(o CalloutOptions) ([]byte, error) {
	listen := o.Listen
	if listen == "" {
		listen = "0.0.0.0:4222"
	}
	issuerEnv, passwordEnv := o.IssuerEnv, o.PasswordEnv
	if issuerEnv == "" {
		issuerEnv = DefaultIssuerEnv
	}
	if passwordEnv == "" {
		passwordEnv = DefaultPasswordEnv
	}
	for _, env := range []string{issuerEnv, passwordEnv, o.ServerNameEnv} {
		if env != "" && !isEnvName(env) {
			return nil, fmt.Errorf("render callout config: %q is not an environment variable name (A-Z, 0-9, _)", env)
		}
	}
	if o.ServerName != "" && o.ServerNameEnv != "" {
		return nil, errors.New("render callout config: give the server name or the variable holding it, not both")
	}
	var b bytes.Buffer
	b.WriteString("# imagefleet nats-server configuration, auth callout mode (natsconf.RenderCallout; docs/security.md).\n")
	fmt.Fprintf(&b, "# Needs the environment variables %s (issuer.pub) and %s (callout.password).\n", issuerEnv, passwordEnv)
	switch {
	case o.ServerName != "":
		fmt.Fprintf(&b, "server_name: %s\n", q(o.ServerName))
	case o.ServerNameEnv != "":
		fmt.Fprintf(&b, "server_name: $%s\n", o.ServerNameEnv)
	}
	fmt.Fprintf(&b, "listen: %s\n", q(listen))
	b.WriteString("max_payload: 1048576\n")
	b.WriteString("jetstream {\n")
	if o.StoreDir != "" {
		fmt.Fprintf(&b, "  store_dir: %s\n", q(o.StoreDir))
	}
	b.WriteString("}\n")
	if o.TLS != nil {
		if o.TLS.Cert == "" || o.TLS.Key == "" {
			return nil, errors.New("render callout config: TLS needs a certificate and a key")
		}
		if o.VerifyClients && o.TLS.CA == "" {
			return nil, errors.New("render callout config: verifying client certificates needs a CA")
		}
		fmt.Fprintf(&b, "tls {\n  cert_file: %s\n  key_file: %s\n", q(o.TLS.Cert), q(o.TLS.Key))
		if o.TLS.CA != "" {
			fmt.Fprintf(&b, "  ca_file: %s\n", q(o.TLS.CA))
		}
		fmt.Fprintf(&b, "  verify: %t\n  timeout: 2\n}\n", o.VerifyClients)
	} else if o.VerifyClients {
		return nil, errors.New("render callout config: verifying client certificates needs TLS")
	}
	if c := o.Cluster; c != nil {
		name, clisten := c.Name, c.Listen
		if name == "" {
			name = "imagefleet"
		}
		if clisten == "" {
			clisten = "0.0.0.0:6222"
		}
		if o.ServerName == "" && o.ServerNameEnv == "" {
			return nil, errors.New("render callout config: a cluster's servers need distinct names (ServerName or ServerNameEnv)")
		}
		fmt.Fprintf(&b, "cluster {\n  name: %s\n  listen: %s\n", q(name), q(clisten))
		if len(c.Routes) > 0 {
			fmt.Fprintf(&b, "  routes: %s\n", list(c.Routes))
		}
		if c.TLS != nil {
			if c.TLS.Cert == "" || c.TLS.Key == "" || c.TLS.CA == "" {
				return nil, errors.New("render callout config: route TLS needs a CA, a certificate and a key")
			}
			fmt.Fprintf(&b, "  tls {\n    cert_file: %s\n    key_file: %s\n    ca_file: %s\n    verify: true\n    timeout: 2\n  }\n",
				q(c.TLS.Cert), q(c.TLS.Key), q(c.TLS.CA))
		}
		b.WriteString("}\n")
	}
	fmt.Fprintf(&b, "accounts {\n  %s {\n    jetstream: enabled\n", Account)
	authUsers := []string{CalloutUser}
	if len(o.Hosts) > 0 {
		b.WriteString("    users: [\n")
		for _, id := range o.Hosts {
			if id.Public == "" || id.LeafOnly {
				return nil, fmt.Errorf("render callout config: host %q needs an nkey for client connections", id.Name)
			}
			fmt.Fprintf(&b, "      # %s %s\n      {\n        nkey: %s\n        permissions: {\n", id.Role, id.Name, q(id.Public))
			fmt.Fprintf(&b, "          publish: { allow: %s }\n          subscribe: { allow: %s }\n", list(id.Perms.Publish), list(id.Perms.Subscribe))
			if id.Perms.AllowResponses {
				b.WriteString("          allow_responses: true\n")
			}
			b.WriteString("        }\n      }\n")
			authUsers = append(authUsers, id.Public)
		}
		b.WriteString("    ]\n")
	}
	b.WriteString("  }\n")
	fmt.Fprintf(&b, "  %s {\n    users: [\n      { user: %s, password: $%s }\n    ]\n  }\n}\n", CalloutAccount, q(CalloutUser), passwordEnv)
	b.WriteString("authorization {\n  auth_callout {\n")
	fmt.Fprintf(&b, "    issuer: $%s\n    auth_users: %s\n    account: %s\n", issuerEnv, list(authUsers), CalloutAccount)
	b.WriteString("  }\n}\n")
	return b.Bytes(), nil
}

func isEnvName(s string) bool {
	for i, r := range s {
		if !(r >= 'A' && r <= 'Z' || r == '_' || i > 0 && r >= '0' && r <= '9') {
			return false
		}
	}
	return s != ""
}
