package main

import (
	"fmt"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/deploy/natsconf"
)

// newGenCredsCmd is `imagefleet bus gen-creds`.
func newGenCredsCmd(cl *cli) *cobra.Command {
	var (
		nodes, rotate, out, listen, tlsDir string
		testCerts                          bool
		hosts                              []string
		// leaf sites
		domain, jsDomain, sites, leafListen, hubURL, siteSeed string
	)
	cmd := &cobra.Command{
		Use:   "gen-creds --nodes a,b,c --out DIR",
		Short: "Write one nkey per node (and for fleet, inventory, admin) and a nats-server config with per-node permissions",
		Long: `Write DIR/nats.conf (account IMAGEFLEET, one nkey user per node allowed only its own subjects, plus the
fleet, inventory and admin users) and the seeds: DIR/nodes/<node>.nk, DIR/fleet.nk, DIR/inventory.nk,
DIR/admin.nk (mode 0600). Existing seeds in DIR are kept; --rotate NAME,... replaces those. Seeds of nodes no
longer listed are deleted. Run the server with: imagefleet bus --config DIR/nats.conf.
With --tls-dir, clients must present a certificate signed by DIR/ca.pem (files ca.pem, server.pem,
server-key.pem; --gen-test-certs writes a test CA and certificates there first).

Leaf sites (docs/operations.md, "Leaf nodes"): at the hub, --domain hub --sites a,b adds one identity per
site (DIR/sites/<site>.nk, leaf connections only) and a leaf listener (--leaf-listen). For each site, with
that site's nodes: --domain <site> --js-domain hub --hub-url nats-leaf://hub:7422 --site-seed
HUBDIR/sites/<site>.nk writes the site server's config (its nodes' users with their rights in both domains,
the admin, the leaf connection to the hub; with --tls-dir it presents client.pem and client-key.pem there).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if out == "" {
				return fmt.Errorf("--out is required")
			}
			list := splitList(nodes)
			if nodes != "" && strings.HasPrefix(nodes, "@") {
				raw, err := os.ReadFile(nodes[1:])
				if err != nil {
					return fmt.Errorf("nodes file: %w", err)
				}
				list = strings.Fields(string(raw))
			}
			o := natsconf.Options{Nodes: list, Listen: listen, Rotate: splitList(rotate), Domain: domain,
				JSDomain: jsDomain, Sites: splitList(sites), LeafListen: leafListen}
			if len(list) == 0 && len(o.Sites) == 0 {
				return fmt.Errorf("--nodes is required (a,b,c or @FILE with one node per line)")
			}
			if hubURL != "" || siteSeed != "" {
				o.LeafRemote = &natsconf.LeafRemote{URL: hubURL, SeedFile: siteSeed}
			}
			if testCerts && tlsDir == "" {
				return fmt.Errorf("--gen-test-certs needs --tls-dir")
			}
			if tlsDir != "" {
				if testCerts {
					if _, err := natsconf.GenerateCerts(tlsDir, hosts, 365*24*time.Hour); err != nil {
						return fmt.Errorf("test certificates: %w", err)
					}
				}
				o.TLS = &natsconf.TLSFiles{CA: tlsDir + "/ca.pem", Cert: tlsDir + "/server.pem", Key: tlsDir + "/server-key.pem"}
				files := []string{o.TLS.CA, o.TLS.Cert, o.TLS.Key}
				if o.LeafRemote != nil {
					o.LeafRemote.TLS = &natsconf.TLSFiles{CA: tlsDir + "/ca.pem", Cert: tlsDir + "/client.pem", Key: tlsDir + "/client-key.pem"}
					files = append(files, o.LeafRemote.TLS.Cert, o.LeafRemote.TLS.Key)
				}
				for _, p := range files {
					if _, err := os.Stat(p); err != nil {
						return fmt.Errorf("tls: %w (deploy/nats/gen-certs.sh or --gen-test-certs writes it)", err)
					}
				}
			}
			res, err := natsconf.Generate(out, o)
			if err != nil {
				return err
			}
			if cl.jsonOutput() {
				type ident struct {
					Name, Role, Public, SeedFile string
				}
				ids := make([]ident, 0, len(res.Identities))
				for _, id := range res.Identities {
					ids = append(ids, ident{id.Name, id.Role, id.Public, id.SeedFile})
				}
				return printJSON(cmd.OutOrStdout(), map[string]any{"config": res.ConfigFile, "identities": ids})
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintf(w, "config: %s\n", res.ConfigFile)
			fmt.Fprintln(w, "NAME\tROLE\tPUBLIC KEY\tSEED FILE")
			for _, id := range res.Identities {
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", id.Name, id.Role, id.Public, id.SeedFile)
			}
			return w.Flush()
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&nodes, "nodes", "", "node names, comma separated, or @FILE (one per line)")
	fs.StringVar(&out, "out", "", "output directory")
	fs.StringVar(&rotate, "rotate", "", "identities whose keys are replaced (node names, fleet, inventory, admin)")
	fs.StringVar(&listen, "listen", "0.0.0.0:4222", "client listen address written to the config")
	fs.StringVar(&tlsDir, "tls-dir", "", "directory with ca.pem, server.pem, server-key.pem: require TLS with client certificates")
	fs.BoolVar(&testCerts, "gen-test-certs", false, "write a test CA and certificates into --tls-dir first (labs and tests only)")
	fs.StringSliceVar(&hosts, "tls-host", nil, "extra host names or IPs of the server certificate (with --gen-test-certs)")
	fs.StringVar(&domain, "domain", "", "this server's JetStream domain (leaf sites: hub, or the site's)")
	fs.StringVar(&jsDomain, "js-domain", "", "the hub's JetStream domain: write a site server's config (with --hub-url, --site-seed)")
	fs.StringVar(&sites, "sites", "", "at the hub: the sites' domains, comma separated; one leaf identity each")
	fs.StringVar(&leafListen, "leaf-listen", "0.0.0.0:7422", "at the hub: the leaf listen address (with --sites)")
	fs.StringVar(&hubURL, "hub-url", "", "at a site: the hub's leaf URL (nats-leaf://hub:7422)")
	fs.StringVar(&siteSeed, "site-seed", "", "at a site: the site's seed from the hub's output (HUBDIR/sites/<site>.nk)")
	return cmd
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
