package natsconf

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/nats-io/nkeys"

	"github.com/imagefleet/imagefleet/events"
)

// Account is the account every imagefleet user belongs to.
const Account = "IMAGEFLEET"

// Options shape the generated server config.
type Options struct {
	// Nodes get one user each.
	Nodes []string
	// Listen is the client listener (default "0.0.0.0:4222").
	Listen string
	// ServerName (default: none; the server picks one).
	ServerName string
	// StoreDir is the JetStream store (default: none, the embedded server's --data-dir decides).
	StoreDir string
	// TLS, when set, requires TLS with a client certificate signed by CA on client connections.
	TLS *TLSFiles
	// Rotate names identities (a node name, or fleet, inventory, admin) whose existing seeds are replaced by
	// new ones; the others keep the seeds found in the output directory.
	Rotate []string
}

// TLSFiles are the server's certificate, key and the CA that signs client certificates.
type TLSFiles struct {
	CA, Cert, Key string
}

// Identity is one generated user.
type Identity struct {
	// Name is the node name, or fleet, inventory, admin.
	Name string
	Role string
	// Public is the nkey public key (U...); SeedFile is where its seed was written.
	Public   string
	SeedFile string
	Perms    Permissions
}

// Result is what Generate wrote.
type Result struct {
	ConfigFile string
	Identities []Identity
}

// SeedFile is where Generate keeps the seed of identity name (nodes under nodes/).
func SeedFile(dir, role, name string) string {
	if role == RoleNode {
		return filepath.Join(dir, "nodes", name+".nk")
	}
	return filepath.Join(dir, name+".nk")
}

// Generate writes dir/nats.conf and one nkey seed file per identity (mode 0600): dir/nodes/<node>.nk,
// dir/fleet.nk, dir/inventory.nk, dir/admin.nk. Existing seeds are kept (so re-running with one more node
// changes nothing for the others) unless the identity is named in o.Rotate. Seeds of nodes no longer listed
// are removed.
func Generate(dir string, o Options) (Result, error) {
	if len(o.Nodes) == 0 {
		return Result{}, errors.New("generate nats config: no nodes")
	}
	seen := map[string]bool{}
	for _, n := range o.Nodes {
		if err := events.ValidateNodeName(n); err != nil {
			return Result{}, fmt.Errorf("generate nats config: %w", err)
		}
		if n == RoleFleet || n == RoleInventory || n == RoleAdmin {
			return Result{}, fmt.Errorf("generate nats config: node name %q is reserved", n)
		}
		if seen[events.NodeToken(n)] {
			return Result{}, fmt.Errorf("generate nats config: node %q is listed twice", n)
		}
		seen[events.NodeToken(n)] = true
	}
	if err := os.MkdirAll(filepath.Join(dir, "nodes"), 0o700); err != nil {
		return Result{}, fmt.Errorf("generate nats config: %w", err)
	}
	type want struct{ role, name string }
	var wants []want
	for _, n := range o.Nodes {
		wants = append(wants, want{RoleNode, n})
	}
	wants = append(wants, want{RoleFleet, RoleFleet}, want{RoleInventory, RoleInventory}, want{RoleAdmin, RoleAdmin})
	var res Result
	for _, w := range wants {
		path := SeedFile(dir, w.role, w.name)
		pub, err := seed(path, slices.Contains(o.Rotate, w.name))
		if err != nil {
			return Result{}, fmt.Errorf("generate nats config: %s: %w", w.name, err)
		}
		id := Identity{Name: w.name, Role: w.role, Public: pub, SeedFile: path}
		switch w.role {
		case RoleNode:
			id.Perms = NodePermissions(w.name, pub)
		case RoleFleet:
			id.Perms = FleetPermissions(pub)
		case RoleInventory:
			id.Perms = InventoryPermissions(pub)
		default:
			id.Perms = AdminPermissions(pub)
		}
		res.Identities = append(res.Identities, id)
	}
	// Seeds of nodes no longer in the fleet: remove, so a decommissioned node's key cannot be reused.
	if entries, err := os.ReadDir(filepath.Join(dir, "nodes")); err == nil {
		for _, e := range entries {
			name := strings.TrimSuffix(e.Name(), ".nk")
			if strings.HasSuffix(e.Name(), ".nk") && !slices.Contains(o.Nodes, name) {
				_ = os.Remove(filepath.Join(dir, "nodes", e.Name()))
			}
		}
	}
	conf, err := Render(o, res.Identities)
	if err != nil {
		return Result{}, err
	}
	res.ConfigFile = filepath.Join(dir, "nats.conf")
	if err := os.WriteFile(res.ConfigFile, conf, 0o640); err != nil {
		return Result{}, fmt.Errorf("generate nats config: %w", err)
	}
	return res, nil
}

// seed returns the public key of the seed in path, creating the seed when missing or when rotate is set.
func seed(path string, rotate bool) (string, error) {
	if !rotate {
		if raw, err := os.ReadFile(path); err == nil {
			kp, err := nkeys.ParseDecoratedNKey(raw)
			if err != nil {
				return "", fmt.Errorf("existing seed %s: %w", path, err)
			}
			defer kp.Wipe()
			return kp.PublicKey()
		}
	}
	kp, err := nkeys.CreateUser()
	if err != nil {
		return "", err
	}
	defer kp.Wipe()
	s, err := kp.Seed()
	if err != nil {
		return "", err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(s, '\n'), 0o600); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, path); err != nil {
		return "", err
	}
	return kp.PublicKey()
}

// Render is the nats-server configuration of o with ids as the account's users.
func Render(o Options, ids []Identity) ([]byte, error) {
	listen := o.Listen
	if listen == "" {
		listen = "0.0.0.0:4222"
	}
	var b bytes.Buffer
	b.WriteString("# imagefleet nats-server configuration, generated by `imagefleet bus gen-creds`.\n")
	b.WriteString("# Re-run the generator instead of editing: it keeps existing keys (see docs/security.md).\n")
	if o.ServerName != "" {
		fmt.Fprintf(&b, "server_name: %s\n", q(o.ServerName))
	}
	fmt.Fprintf(&b, "listen: %s\n", q(listen))
	b.WriteString("max_payload: 1048576\n")
	b.WriteString("jetstream {\n")
	if o.StoreDir != "" {
		fmt.Fprintf(&b, "  store_dir: %s\n", q(o.StoreDir))
	}
	b.WriteString("}\n")
	if o.TLS != nil {
		if o.TLS.Cert == "" || o.TLS.Key == "" || o.TLS.CA == "" {
			return nil, errors.New("render nats config: TLS needs a CA, a certificate and a key")
		}
		b.WriteString("tls {\n")
		fmt.Fprintf(&b, "  cert_file: %s\n  key_file: %s\n  ca_file: %s\n", q(o.TLS.Cert), q(o.TLS.Key), q(o.TLS.CA))
		b.WriteString("  verify: true\n  timeout: 2\n}\n")
	}
	fmt.Fprintf(&b, "accounts {\n  %s {\n    jetstream: enabled\n    users: [\n", Account)
	for _, id := range ids {
		fmt.Fprintf(&b, "      # %s %s\n      {\n        nkey: %s\n        permissions: {\n", id.Role, id.Name, q(id.Public))
		fmt.Fprintf(&b, "          publish: { allow: %s }\n", list(id.Perms.Publish))
		fmt.Fprintf(&b, "          subscribe: { allow: %s }\n", list(id.Perms.Subscribe))
		if id.Perms.AllowResponses {
			b.WriteString("          allow_responses: true\n")
		}
		b.WriteString("        }\n      }\n")
	}
	b.WriteString("    ]\n  }\n}\n")
	return b.Bytes(), nil
}

func q(s string) string { return strconv.Quote(s) }

func list(ss []string) string {
	qs := make([]string, len(ss))
	for i, s := range ss {
		qs[i] = q(s)
	}
	return "[" + strings.Join(qs, ", ") + "]"
}
