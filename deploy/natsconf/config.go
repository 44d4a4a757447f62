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
	// Rotate names identities (a node name, or fleet, inventory, admin, a site's domain) whose existing seeds
	// are replaced by new ones; the others keep the seeds found in the output directory.
	Rotate []string

	// Leaf sites (docs/operations.md, "Leaf nodes"): a hub and one leaf server per site, each a JetStream
	// domain of its own. All empty: one domain, as before.

	// Domain is this server's JetStream domain (default: none): "hub" for the hub, the site's for a site.
	Domain string
	// JSDomain is the fleet's (the hub's) JetStream domain when this is a site's server: the nodes' users get
	// each right in the domain of its stream or bucket (NodePermissions), and only nodes and the admin get a
	// user here (the fleet and the inventory work at the hub). Needs LeafRemote.
	JSDomain string
	// Sites are the domains of the sites whose leaf connections this hub accepts: one identity each (role
	// site, seed sites/<domain>.nk, leaf connections only), which the site's config (LeafRemote) uses.
	Sites []string
	// LeafListen is where the hub accepts leaf connections (default "0.0.0.0:7422" when Sites are set); with
	// TLS they use the same files and need a client certificate too.
	LeafListen string
	// LeafRemote is a site's connection to the hub.
	LeafRemote *LeafRemote
}

// LeafRemote is a site server's leaf connection to the hub: it authenticates with the site's identity,
// written by the hub's Generate (Options.Sites), and binds the site's account to the hub's.
type LeafRemote struct {
	// URL of the hub's leaf listener (nats-leaf://hub:7422).
	URL string
	// SeedFile is the site's seed, from the hub's output directory (sites/<domain>.nk). It is copied into the
	// site's nats.conf, which is then written mode 0600.
	SeedFile string
	// TLS, when set, is the client certificate, key and the CA of the hub's certificate.
	TLS *TLSFiles
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
	// LeafOnly: the identity authenticates leaf connections only (a site), never a client.
	LeafOnly bool
}

// Result is what Generate wrote.
type Result struct {
	ConfigFile string
	Identities []Identity
}

// SeedFile is where Generate keeps the seed of identity name (nodes under nodes/).
func SeedFile(dir, role, name string) string {
	switch role {
	case RoleNode:
		return filepath.Join(dir, "nodes", name+".nk")
	case RoleSite:
		return filepath.Join(dir, "sites", name+".nk")
	}
	return filepath.Join(dir, name+".nk")
}

// Generate writes dir/nats.conf and one nkey seed file per identity (mode 0600): dir/nodes/<node>.nk,
// dir/fleet.nk, dir/inventory.nk, dir/admin.nk. Existing seeds are kept (so re-running with one more node
// changes nothing for the others) unless the identity is named in o.Rotate. Seeds of nodes no longer listed
// are removed.
func Generate(dir string, o Options) (Result, error) {
	if len(o.Nodes) == 0 && len(o.Sites) == 0 {
		return Result{}, errors.New("generate nats config: no nodes")
	}
	if err := o.validateDomains(); err != nil {
		return Result{}, fmt.Errorf("generate nats config: %w", err)
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
	for _, sub := range []string{"nodes", "sites"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o700); err != nil {
			return Result{}, fmt.Errorf("generate nats config: %w", err)
		}
	}
	type want struct{ role, name string }
	var wants []want
	for _, n := range o.Nodes {
		wants = append(wants, want{RoleNode, n})
	}
	for _, d := range o.Sites {
		wants = append(wants, want{RoleSite, d})
	}
	if o.JSDomain == "" { // a site's server has no fleet or inventory clients
		wants = append(wants, want{RoleFleet, RoleFleet}, want{RoleInventory, RoleInventory})
	}
	wants = append(wants, want{RoleAdmin, RoleAdmin})
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
			id.Perms = NodePermissions(w.name, pub, o.JSDomain)
		case RoleSite:
			id.Perms, id.LeafOnly = SitePermissions(w.name, o.Sites), true
		case RoleFleet:
			id.Perms = FleetPermissions(pub)
		case RoleInventory:
			id.Perms = InventoryPermissions(pub)
		default:
			id.Perms = AdminPermissions(pub)
		}
		res.Identities = append(res.Identities, id)
	}
	// Seeds of nodes (and sites) no longer in the fleet: remove, so a decommissioned node's key cannot be
	// reused.
	for sub, listed := range map[string][]string{"nodes": o.Nodes, "sites": o.Sites} {
		if entries, err := os.ReadDir(filepath.Join(dir, sub)); err == nil {
			for _, e := range entries {
				name := strings.TrimSuffix(e.Name(), ".nk")
				if strings.HasSuffix(e.Name(), ".nk") && !slices.Contains(listed, name) {
					_ = os.Remove(filepath.Join(dir, sub, e.Name()))
				}
			}
		}
	}
	conf, err := Render(o, res.Identities)
	if err != nil {
		return Result{}, err
	}
	res.ConfigFile = filepath.Join(dir, "nats.conf")
	mode := os.FileMode(0o640)
	if o.LeafRemote != nil {
		mode = 0o600 // it holds the site's seed
	}
	if err := os.WriteFile(res.ConfigFile, conf, mode); err != nil {
		return Result{}, fmt.Errorf("generate nats config: %w", err)
	}
	return res, nil
}

// validateDomains checks the leaf-site options: a site (JSDomain) names its own domain, another one, and
// its connection to the hub; a hub lists valid site domains.
func (o Options) validateDomains() error {
	for _, d := range append([]string{o.Domain, o.JSDomain}, o.Sites...) {
		if d != "" {
			if err := events.ValidateDomain(d); err != nil {
				return err
			}
		}
	}
	switch {
	case o.JSDomain != "" && (o.Domain == "" || o.Domain == o.JSDomain):
		return fmt.Errorf("a site's server (fleet domain %q) needs a JetStream domain of its own", o.JSDomain)
	case o.JSDomain != "" && (o.LeafRemote == nil || o.LeafRemote.URL == "" || o.LeafRemote.SeedFile == ""):
		return errors.New("a site's server needs its leaf connection to the hub: a URL and the site's seed")
	case o.JSDomain == "" && o.LeafRemote != nil:
		return errors.New("a leaf connection to the hub needs the hub's JetStream domain")
	case o.JSDomain != "" && len(o.Sites) > 0:
		return errors.New("a site's server accepts no sites")
	}
	seen := map[string]bool{}
	for _, d := range o.Sites {
		if seen[d] || d == o.Domain {
			return fmt.Errorf("site %q is listed twice or is the hub's own domain", d)
		}
		seen[d] = true
	}
	return nil
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
	if o.Domain != "" {
		fmt.Fprintf(&b, "  domain: %s\n", q(o.Domain))
	}
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
	if err := renderLeaf(&b, o); err != nil {
		return nil, err
	}
	fmt.Fprintf(&b, "accounts {\n  %s {\n    jetstream: enabled\n    users: [\n", Account)
	for _, id := range ids {
		fmt.Fprintf(&b, "      # %s %s\n      {\n        nkey: %s\n        permissions: {\n", id.Role, id.Name, q(id.Public))
		deny := ""
		if len(id.Perms.Deny) > 0 {
			deny = ", deny: " + list(id.Perms.Deny)
		}
		fmt.Fprintf(&b, "          publish: { allow: %s%s }\n", list(id.Perms.Publish), deny)
		fmt.Fprintf(&b, "          subscribe: { allow: %s%s }\n", list(id.Perms.Subscribe), deny)
		if id.Perms.AllowResponses {
			b.WriteString("          allow_responses: true\n")
		}
		b.WriteString("        }\n")
		if id.LeafOnly {
			b.WriteString("        allowed_connection_types: [\"LEAFNODE\"]\n")
		}
		b.WriteString("      }\n")
	}
	b.WriteString("    ]\n  }\n}\n")
	return b.Bytes(), nil
}

// renderLeaf writes the leafnodes block: the hub's listener for its sites (authenticated by the sites'
// users of the account: no leafnodes authorization block, so nats-server checks a leaf connection against
// the account's users and binds it to their account), or a site's remote to the hub, bound to the account.
func renderLeaf(b *bytes.Buffer, o Options) error {
	switch {
	case len(o.Sites) > 0:
		listen := o.LeafListen
		if listen == "" {
			listen = "0.0.0.0:7422"
		}
		fmt.Fprintf(b, "leafnodes {\n  listen: %s\n", q(listen))
		if o.TLS != nil {
			fmt.Fprintf(b, "  tls {\n    cert_file: %s\n    key_file: %s\n    ca_file: %s\n    verify: true\n    timeout: 2\n  }\n",
				q(o.TLS.Cert), q(o.TLS.Key), q(o.TLS.CA))
		}
		b.WriteString("}\n")
	case o.LeafRemote != nil:
		r := o.LeafRemote
		raw, err := os.ReadFile(r.SeedFile)
		if err != nil {
			return fmt.Errorf("render nats config: the site's seed: %w", err)
		}
		defer wipe(raw)
		kp, err := nkeys.ParseDecoratedNKey(raw)
		if err != nil {
			return fmt.Errorf("render nats config: the site's seed %s: %w", r.SeedFile, err)
		}
		defer kp.Wipe()
		seed, err := kp.Seed()
		if err != nil {
			return fmt.Errorf("render nats config: the site's seed %s: %w", r.SeedFile, err)
		}
		defer wipe(seed)
		fmt.Fprintf(b, "leafnodes {\n  remotes: [\n    {\n      urls: [ %s ]\n      account: %s\n      nkey: %s\n", q(r.URL), q(Account), q(string(seed)))
		// Every site's pull queues take the plain pull subjects: keep them off the link, or a request published
		// at the hub would be stored at every site (the hub addresses a site's nodes by events.DomainSubject).
		fmt.Fprintf(b, "      deny_imports: %s\n", list([]string{events.PullSubjects, events.PullSubjects + ".*"}))
		if r.TLS != nil {
			if r.TLS.Cert == "" || r.TLS.Key == "" || r.TLS.CA == "" {
				return errors.New("render nats config: the leaf connection's TLS needs a CA, a certificate and a key")
			}
			fmt.Fprintf(b, "      tls {\n        cert_file: %s\n        key_file: %s\n        ca_file: %s\n      }\n",
				q(r.TLS.Cert), q(r.TLS.Key), q(r.TLS.CA))
		}
		b.WriteString("    }\n  ]\n}\n")
	}
	return nil
}

func wipe(b []byte) {
	for i := range b {
		b[i] = 'x'
	}
}

func q(s string) string { return strconv.Quote(s) }

func list(ss []string) string {
	qs := make([]string, len(ss))
	for i, s := range ss {
		qs[i] = q(s)
	}
	return "[" + strings.Join(qs, ", ") + "]"
}
