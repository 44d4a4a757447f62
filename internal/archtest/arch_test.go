package archtest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/imagefleet/imagefleet"

// pkg is what the rules read of one package of the module (a subset of `go list -json`).
type pkg struct {
	ImportPath   string
	Imports      []string // direct imports of the package's non-test files
	Deps         []string // every package the non-test build needs, transitively
	TestImports  []string // direct imports of its _test.go files in the package
	XTestImports []string // direct imports of its _test.go files in package x_test
}

// kind is the part of the architecture a package belongs to, decided by its path alone, so a new package
// falls under the rules as soon as it exists: any services/<name> other than cri is a worker, and its
// subpackages (test kits such as gc/gctest, fleet/fleettest) belong to the same worker.
type kind struct {
	part   string // "events", "bus", "cri", "worker", "other"; outside the module: "external"
	worker string // services/<worker>, for part "worker"
}

func classify(path string) kind {
	rest, ok := strings.CutPrefix(path, module+"/")
	if !ok {
		return kind{part: "external"}
	}
	first, after, _ := strings.Cut(rest, "/")
	switch first {
	case "events":
		return kind{part: "events"}
	case "bus":
		return kind{part: "bus"}
	case "services":
		name, _, _ := strings.Cut(after, "/")
		if name == "cri" {
			// The CRI client and its hollow runtime: a client every worker may use, not a worker.
			return kind{part: "cri"}
		}
		return kind{part: "worker", worker: name}
	}
	return kind{part: "other"}
}

// natsClient is the NATS client library: only bus speaks NATS.
const natsClient = "github.com/nats-io/nats.go"

func isNATSClient(path string) bool {
	return path == natsClient || strings.HasPrefix(path, natsClient+"/")
}

// otherNATS names every import of a github.com/nats-io package other than the client, by importer, with
// its reason. An import missing from this table fails the test: add it here with a reason, or do not add it.
var otherNATS = map[string]map[string]string{
	module + "/bus": {
		"github.com/nats-io/nats-server/v2/server": "the embedded nats-server (NATS embedded in-process by default, docs/architecture.md)",
		"github.com/nats-io/nkeys":                 "bus.Connect authenticates with an nkey seed file (NATS's own signing)",
	},
	module + "/deploy/natsconf": {
		"github.com/nats-io/nkeys": "key generation for the per-node identities of the generated server config",
	},
	module + "/internal/authcallout": {
		"github.com/nats-io/jwt/v2": "signs nats-server's auth callout responses and the user JWTs in them",
		"github.com/nats-io/nkeys":  "the callout's issuer account key",
	},
}

// testNATSClient names the test files that use the NATS client directly, with the reason bus cannot serve
// them. Production code has no such exception.
var testNATSClient = map[string]string{
	module + "/services/podindex": "flush_test purges the node's pod events from the stream as an operator would " +
		"(events gone before delivery); bus offers no purge, on purpose",
	module + "/deploy": "makes an account key as `imagefleet bus keys` does, to start the chart's NATS config in callout mode",
	module + "/integration": "the security tests act with a node's rights through nats.go alone, to show what any client " +
		"holding them can do beyond what bus does (a push consumer aimed at another node's commands)",
}

// violation is one broken rule: from depends on to (directly or not, as the rule says).
type violation struct{ rule, from, to string }

func (v violation) String() string {
	return fmt.Sprintf("%s: %s imports %s", v.rule, short(v.from), short(v.to))
}

func short(p string) string { return strings.TrimPrefix(p, module+"/") }

// check applies the rules of docs/architecture.md ("Dependency rules") to pkgs. Import rules between parts
// use the transitive non-test dependencies (a worker that reaches another through a helper package still
// breaks the rule); the NATS rules use the direct imports, test files included.
func check(pkgs []pkg) []violation {
	var out []violation
	for _, p := range pkgs {
		from := classify(p.ImportPath)
		for _, d := range p.Deps {
			to := classify(d)
			switch {
			case from.part == "events" && (to.part == "bus" || to.part == "cri" || strings.HasPrefix(d, "github.com/nats-io/")):
				out = append(out, violation{"events knows no transport (no bus, no CRI, no NATS)", p.ImportPath, d})
			case from.part == "worker" && to.part == "worker" && to.worker != from.worker:
				out = append(out, violation{"workers talk only through messages (no worker imports another)", p.ImportPath, d})
			case from.part == "bus" && (to.part == "worker" || to.part == "cri"):
				out = append(out, violation{"bus imports no services/*", p.ImportPath, d})
			}
		}
		for _, d := range p.Imports {
			switch {
			case isNATSClient(d) && from.part != "bus":
				out = append(out, violation{"only bus imports " + natsClient, p.ImportPath, d})
			case !isNATSClient(d) && strings.HasPrefix(d, "github.com/nats-io/") && otherNATS[p.ImportPath][d] == "":
				out = append(out, violation{"a github.com/nats-io import not named in otherNATS with its reason", p.ImportPath, d})
			}
		}
		for _, d := range slices.Concat(p.TestImports, p.XTestImports) {
			if strings.HasPrefix(d, "github.com/nats-io/") && from.part != "bus" && testNATSClient[p.ImportPath] == "" &&
				otherNATS[p.ImportPath][d] == "" {
				out = append(out, violation{"a test outside bus imports NATS without a reason in testNATSClient", p.ImportPath, d})
			}
		}
	}
	slices.SortFunc(out, func(a, b violation) int { return strings.Compare(a.String(), b.String()) })
	return slices.Compact(out)
}

// list runs `go list -json` over the module.
func list(t *testing.T) []pkg {
	t.Helper()
	root, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("go env GOMOD: %v", err)
	}
	cmd := exec.Command("go", "list", "-json=ImportPath,Imports,Deps,TestImports,XTestImports", "./...")
	cmd.Dir = filepath.Dir(strings.TrimSpace(string(root)))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	raw, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.String())
	}
	var pkgs []pkg
	dec := json.NewDecoder(bytes.NewReader(raw))
	for {
		var p pkg
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("decode go list output: %v", err)
		}
		pkgs = append(pkgs, p)
	}
	return pkgs
}

// TestDependencyRules checks the module's import graph against the rules of docs/architecture.md,
// "Dependency rules".
func TestDependencyRules(t *testing.T) {
	pkgs := list(t)
	// The rules are only as good as the graph they read: the parts they name must be in it.
	seen := map[string]bool{}
	for _, p := range pkgs {
		seen[short(p.ImportPath)] = true
	}
	for _, want := range []string{"events", "bus", "services/cri", "services/detector", "services/gc", "services/gc/gctest",
		"services/puller", "services/podindex", "services/cache", "services/fleet", "deploy/natsconf"} {
		if !seen[want] {
			t.Errorf("go list did not report %s: the rules would check nothing there", want)
		}
	}
	for _, v := range check(pkgs) {
		t.Error(v)
	}
	// Every named exception is still needed: a reason for an import that is gone misleads the next reader.
	for importer, imports := range otherNATS {
		for imp := range imports {
			i := slices.IndexFunc(pkgs, func(p pkg) bool { return p.ImportPath == importer })
			if i < 0 || !slices.Contains(pkgs[i].Imports, imp) {
				t.Errorf("otherNATS names %s -> %s, which is no longer imported: remove it", short(importer), imp)
			}
		}
	}
	for importer := range testNATSClient {
		i := slices.IndexFunc(pkgs, func(p pkg) bool { return p.ImportPath == importer })
		natsImport := func(d string) bool { return strings.HasPrefix(d, "github.com/nats-io/") }
		if i < 0 || !slices.ContainsFunc(slices.Concat(pkgs[i].TestImports, pkgs[i].XTestImports), natsImport) {
			t.Errorf("testNATSClient names %s, whose tests no longer import a github.com/nats-io package: remove it", short(importer))
		}
	}
}

// TestRulesCatch feeds the checker made-up graphs: each rule fires on the import it forbids, and a package
// that does not exist yet (services/newworker) is a worker without being listed anywhere.
func TestRulesCatch(t *testing.T) {
	m := func(s string) string { return module + "/" + s }
	tests := []struct {
		name string
		p    pkg
		want string // a substring of the one violation; "" for none
	}{
		{"worker imports worker", pkg{ImportPath: m("services/gc"), Deps: []string{m("services/detector")}}, "workers talk only"},
		{"indirectly", pkg{ImportPath: m("services/gc"), Deps: []string{m("internal/x"), m("services/puller")}}, "workers talk only"},
		{"test kit imports another worker", pkg{ImportPath: m("services/gc/gctest"), Deps: []string{m("services/detector")}}, "workers talk only"},
		{"new worker", pkg{ImportPath: m("services/newworker"), Deps: []string{m("services/podindex/podtest")}}, "workers talk only"},
		{"worker imports its own test kit", pkg{ImportPath: m("services/gc"), Deps: []string{m("services/gc/gctest")}}, ""},
		{"worker imports cri", pkg{ImportPath: m("services/gc"), Deps: []string{m("services/cri"), m("services/cri/hollow")}}, ""},
		{"events imports bus", pkg{ImportPath: m("events"), Deps: []string{m("bus")}}, "events knows no transport"},
		{"events imports cri", pkg{ImportPath: m("events"), Deps: []string{m("services/cri")}}, "events knows no transport"},
		{"events imports nats", pkg{ImportPath: m("events"), Deps: []string{"github.com/nats-io/nuid"}}, "events knows no transport"},
		{"bus imports a worker", pkg{ImportPath: m("bus/journal"), Deps: []string{m("services/puller")}}, "bus imports no services"},
		{"bus imports cri", pkg{ImportPath: m("bus"), Deps: []string{m("services/cri")}}, "bus imports no services"},
		{"worker imports nats.go", pkg{ImportPath: m("services/cache"), Imports: []string{natsClient + "/jetstream"}}, "only bus imports"},
		{"bus subpackage imports nats.go", pkg{ImportPath: m("bus/journal"), Imports: []string{natsClient}}, ""},
		{"unnamed nkeys", pkg{ImportPath: m("cmd/imagefleet"), Imports: []string{"github.com/nats-io/nkeys"}}, "not named in otherNATS"},
		{"named nkeys", pkg{ImportPath: m("deploy/natsconf"), Imports: []string{"github.com/nats-io/nkeys"}}, ""},
		{"test imports nats.go", pkg{ImportPath: m("services/gc"), XTestImports: []string{natsClient}}, "a test outside bus"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := check([]pkg{tt.p})
			switch {
			case tt.want == "" && len(got) != 0:
				t.Errorf("violations = %v, want none", got)
			case tt.want != "" && (len(got) != 1 || !strings.Contains(got[0].rule, tt.want)):
				t.Errorf("violations = %v, want one %q", got, tt.want)
			}
		})
	}
}
