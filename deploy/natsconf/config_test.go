package natsconf

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/imagefleet/imagefleet/events"
)

// TestNodePermissionsOnASite: on a site (hub "hub") each right names the domain of its stream or bucket,
// and nothing else changes; no right names a third domain.
func TestNodePermissionsOnASite(t *testing.T) {
	const node = "node-1.example"
	tok := events.NodeToken(node)
	one := NodePermissions(node, "UPUB", "")
	site := NodePermissions(node, "UPUB", "hub")
	if !slices.Equal(one.Subscribe, site.Subscribe) || one.AllowResponses != site.AllowResponses {
		t.Errorf("subscribe permissions differ on a site: %v vs %v", one.Subscribe, site.Subscribe)
	}
	for _, tc := range []struct {
		name      string
		want, not string
	}{
		{"heartbeat write in the hub", "$JS.hub.API.$KV." + events.NodesBucket + "." + tok, "$KV." + events.NodesBucket + "." + tok},
		{"heartbeat read in the hub", "$JS.hub.API.DIRECT.GET.KV_" + events.NodesBucket + ".$KV." + events.NodesBucket + "." + tok,
			"$JS.API.DIRECT.GET.KV_" + events.NodesBucket + ".$KV." + events.NodesBucket + "." + tok},
		{"own events read in the hub", "$JS.hub.API.CONSUMER.CREATE." + events.EventsStream + ".*." + events.NodeEvents(node),
			"$JS.API.CONSUMER.CREATE." + events.EventsStream + ".*." + events.NodeEvents(node)},
		{"pod events read in the hub", "$JS.hub.API.CONSUMER.MSG.NEXT." + events.PodsStream + ".*", "$JS.API.CONSUMER.MSG.NEXT." + events.PodsStream + ".*"},
		{"records at the site", "$KV." + events.RecordsBucket + "." + tok + ".>", "$JS.hub.API.$KV." + events.RecordsBucket + "." + tok + ".>"},
		{"GC lease at the site", "$KV." + events.GCLeaseBucket + "." + tok, "$JS.hub.API.$KV." + events.GCLeaseBucket + "." + tok},
		{"GC policy read in the hub", "$JS.hub.API.DIRECT.GET.KV_" + events.GCPolicyBucket + ".$KV." + events.GCPolicyBucket + "." + tok,
			"$JS.API.DIRECT.GET.KV_" + events.GCPolicyBucket + ".$KV." + events.GCPolicyBucket + "." + tok},
		{"pull consumer at the site", "$JS.API.CONSUMER.MSG.NEXT." + events.PullStreamOf(node) + "." + events.PullerDurable(node),
			"$JS.hub.API.CONSUMER.MSG.NEXT." + events.PullStreamOf(node) + "." + events.PullerDurable(node)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !slices.Contains(site.Publish, tc.want) {
				t.Errorf("lacks %s", tc.want)
			}
			if slices.Contains(site.Publish, tc.not) {
				t.Errorf("has %s", tc.not)
			}
		})
	}
	for _, s := range site.Publish {
		if strings.HasPrefix(s, "$JS.") && !strings.HasPrefix(s, "$JS.API.") && !strings.HasPrefix(s, "$JS.hub.API.") &&
			!strings.HasPrefix(s, "$JS.ACK.") {
			t.Errorf("right in another domain: %s", s)
		}
	}
	// The same rights otherwise: every one-domain subject has its counterpart on the site.
	if len(one.Publish)+2 != len(site.Publish) { // + the hub's INFO and STREAM.INFO
		t.Errorf("%d rights on one domain, %d on a site; want 2 more (the hub's info)", len(one.Publish), len(site.Publish))
	}
}

// TestGenerateSites: the hub's config accepts its sites' leaf connections with leaf-only identities; a
// site's config has its domain, its nodes and the admin (no fleet, no inventory), and its leaf connection
// bound to the account with the site's seed (so the file is private).
func TestGenerateSites(t *testing.T) {
	dir := t.TempDir()
	hub, err := Generate(filepath.Join(dir, "hub"), Options{Domain: "hub", Sites: []string{"leaf-a", "leaf-b"}, LeafListen: "127.0.0.1:7422"})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, id := range hub.Identities {
		names = append(names, id.Role+"/"+id.Name)
	}
	if want := []string{"site/leaf-a", "site/leaf-b", "fleet/fleet", "inventory/inventory", "admin/admin"}; !slices.Equal(names, want) {
		t.Errorf("hub identities %v, want %v", names, want)
	}
	conf, err := os.ReadFile(hub.ConfigFile)
	if err != nil {
		t.Fatal(err)
	}
	// Each site is kept out of the other's domain, both ways.
	denyB := `deny: ["$JS.leaf-b.API.>", "imagefleet.domain.leaf-b.>"]`
	for _, want := range []string{`domain: "hub"`, "leafnodes {\n  listen: \"127.0.0.1:7422\"", `allowed_connection_types: ["LEAFNODE"]`,
		`publish: { allow: [">"], ` + denyB + ` }`, `subscribe: { allow: [">"], ` + denyB + ` }`} {
		if !strings.Contains(string(conf), want) {
			t.Errorf("hub config lacks %q:\n%s", want, conf)
		}
	}
	if strings.Count(string(conf), "allowed_connection_types") != 2 {
		t.Errorf("only the sites' identities are leaf-only:\n%s", conf)
	}

	siteSeed := SeedFile(filepath.Join(dir, "hub"), RoleSite, "leaf-a")
	site, err := Generate(filepath.Join(dir, "leaf-a"), Options{Nodes: []string{"n1"}, Domain: "leaf-a", JSDomain: "hub",
		LeafRemote: &LeafRemote{URL: "nats-leaf://hub:7422", SeedFile: siteSeed}})
	if err != nil {
		t.Fatal(err)
	}
	names = names[:0]
	for _, id := range site.Identities {
		names = append(names, id.Role+"/"+id.Name)
	}
	if want := []string{"node/n1", "admin/admin"}; !slices.Equal(names, want) {
		t.Errorf("site identities %v, want %v", names, want)
	}
	conf, err = os.ReadFile(site.ConfigFile)
	if err != nil {
		t.Fatal(err)
	}
	seed, err := os.ReadFile(siteSeed)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`domain: "leaf-a"`, `urls: [ "nats-leaf://hub:7422" ]`, `account: "IMAGEFLEET"`,
		`nkey: "` + strings.TrimSpace(string(seed)) + `"`, `deny_imports: ["imagefleet.cmd.*.pull", "imagefleet.cmd.*.pull.*"]`,
		`"$JS.hub.API.$KV.imagefleet-nodes.n1"`} {
		if !strings.Contains(string(conf), want) {
			t.Errorf("site config lacks %q:\n%s", want, conf)
		}
	}
	if fi, err := os.Stat(site.ConfigFile); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("site config mode %v (%v), want 0600: it holds the site's seed", fi.Mode().Perm(), err)
	}
}

func TestGenerateSitesRefusesBadLayouts(t *testing.T) {
	remote := &LeafRemote{URL: "nats-leaf://hub:7422", SeedFile: "/nonexistent"}
	for _, tc := range []struct {
		name string
		o    Options
		want string
	}{
		{"site without its own domain", Options{Nodes: []string{"n1"}, JSDomain: "hub", LeafRemote: remote}, "needs a JetStream domain of its own"},
		{"site in the hub's domain", Options{Nodes: []string{"n1"}, Domain: "hub", JSDomain: "hub", LeafRemote: remote}, "needs a JetStream domain of its own"},
		{"site without its leaf connection", Options{Nodes: []string{"n1"}, Domain: "a", JSDomain: "hub"}, "needs its leaf connection"},
		{"leaf connection without the hub's domain", Options{Nodes: []string{"n1"}, Domain: "a", LeafRemote: remote}, "needs the hub's JetStream domain"},
		{"site accepting sites", Options{Nodes: []string{"n1"}, Domain: "a", JSDomain: "hub", LeafRemote: remote, Sites: []string{"b"}}, "accepts no sites"},
		{"domain with a dot", Options{Domain: "hub", Sites: []string{"a.b"}}, "not one subject token"},
		{"site listed twice", Options{Domain: "hub", Sites: []string{"a", "a"}}, "listed twice"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Generate(t.TempDir(), tc.o)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want %q", err, tc.want)
			}
		})
	}
}

// TestNodeReadsItsGCPolicyOnly: a node may read its own key of the ImageGCPolicy bucket and write none,
// on the fleet's servers and on a site; the fleet identity writes every key.
func TestNodeReadsItsGCPolicyOnly(t *testing.T) {
	const node = "node-1.example"
	tok := events.NodeToken(node)
	b := events.GCPolicyBucket
	for _, hub := range []string{"", "hub"} {
		p := NodePermissions(node, "UPUB", hub)
		api := "$JS.API."
		if hub != "" {
			api = "$JS.hub.API."
		}
		if !slices.Contains(p.Publish, api+"DIRECT.GET.KV_"+b+".$KV."+b+"."+tok) {
			t.Errorf("hub %q: cannot read its own policy", hub)
		}
		for _, s := range p.Publish {
			if strings.Contains(s, "$KV."+b) && !strings.Contains(s, "$KV."+b+"."+tok) {
				t.Errorf("hub %q: a right on another node's policy: %s", hub, s)
			}
			// Its rights on the bucket are that direct get and, until the earlier agents are gone, their watch
			// of the same key (compat_policy_watch.go): no write.
			if strings.Contains(s, "KV_"+b) && s != api+"DIRECT.GET.KV_"+b+".$KV."+b+"."+tok &&
				!slices.Contains(legacyPolicyWatchPermissions(api, b, tok), s) {
				t.Errorf("hub %q: a right on the policy bucket beyond reading its own key: %s", hub, s)
			}
			if strings.HasSuffix(s, "$KV."+b+"."+tok) && !strings.Contains(s, ".DIRECT.GET.") && !strings.Contains(s, ".CONSUMER.CREATE.") {
				t.Errorf("hub %q: a write of its own policy: %s", hub, s)
			}
		}
	}
	if p := NodePermissions(node, "UPUB", ""); !slices.Contains(p.Subscribe, events.Prefix+".cmd."+tok+".>") ||
		!strings.HasPrefix(events.GCPolicyNotice(node), events.Prefix+".cmd."+tok+".") {
		t.Errorf("the node cannot hear its policy's notices on %s: subscribe %v", events.GCPolicyNotice(node), p.Subscribe)
	}
	if f := FleetPermissions("FPUB"); !slices.Contains(f.Publish, "$KV."+b+".>") || !slices.Contains(f.Publish, "$KV."+events.GCCopiesBucket+".>") {
		t.Errorf("the fleet cannot write the policies or the copies ledger: %v", f.Publish)
	}
	// keepCopies: a node asks the fleet's copies arbiter under its own name only, and never writes the ledger.
	for _, s := range NodePermissions(node, "UPUB", "").Publish {
		if strings.HasPrefix(s, events.Prefix+".fleet.") && s != events.CopiesSubject(node) {
			t.Errorf("a fleet subject beyond its copies request: %s", s)
		}
		if strings.Contains(s, events.GCCopiesBucket) {
			t.Errorf("a right on the copies ledger: %s", s)
		}
	}
	if !slices.Contains(NodePermissions(node, "UPUB", "").Publish, events.CopiesSubject(node)) {
		t.Error("a node cannot ask the copies arbiter")
	}
}
