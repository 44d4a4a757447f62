package events

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// wireNames is every name on the wire, by its Go name: the constants, and the functions that build names
// applied to a sample node whose name has a dot (the case NodeToken exists for).
func wireNames() [][2]string {
	const node = "node-1.example"
	c := func(name, value string) [2]string { return [2]string{name, value} }
	names := [][2]string{
		c("Prefix", Prefix),
		// Streams and their subjects.
		c("EventsStream", EventsStream), c("EventsSubjects", EventsSubjects), c("PodsStream", PodsStream), c("PodsStreamFilter", PodsStreamFilter),
		c("PullStream", PullStream), c("PullSubjects", PullSubjects),
		// The partitioned pull queue: the partition of a node is contract (a changed hash moves nodes).
		c("PullPartitions", fmt.Sprint(PullPartitions)), c("PullPartitionMaxConsumers", fmt.Sprint(PullPartitionMaxConsumers)),
		c("PullPartitionStreamPrefix", PullPartitionStreamPrefix),
		c("SharedStreamMaxConsumers", fmt.Sprint(SharedStreamMaxConsumers)),
		c("PullPartitionStream(0)", PullPartitionStream(0)), c("PullPartitionStream(15)", PullPartitionStream(15)),
		c("PullPartitionSubjects(0)", PullPartitionSubjects(0)), c("PullPartitionSubjects(15)", PullPartitionSubjects(15)),
		c("PullSubject(node)", PullSubject(node)), c("PullStreamOf(node)", PullStreamOf(node)),
		c("LegacyPullSubject(node)", LegacyPullSubject(node)),
		c("PullPartition(hollow-0)", fmt.Sprint(PullPartition("hollow-0"))),
		c("PullPartition(hollow-1100)", fmt.Sprint(PullPartition("hollow-1100"))),
		c("PullPartition(ip-10-0-0-1.ec2.internal)", fmt.Sprint(PullPartition("ip-10-0-0-1.ec2.internal"))),
		// A pull request addressed to a node's leaf domain (docs/operations.md, "Leaf nodes").
		c("DomainRoot", DomainRoot), c("DomainSubject(leaf-a, PullSubject(node))", DomainSubject("leaf-a", PullSubject(node))),
		c("RolloutStream", RolloutStream), c("RolloutSubjects", RolloutSubjects),
		// The inventory's partitioned copy of the image events: the partition of a node is contract.
		c("InventoryStream", InventoryStream), c("InventoryPartitions", fmt.Sprint(InventoryPartitions)),
		c("InventorySourceFilter", InventorySourceFilter), c("InventorySourceTransform()", InventorySourceTransform()),
		c("InventoryPartitionDurablePrefix", InventoryPartitionDurablePrefix),
		c("InventoryPartitionDurable(0)", InventoryPartitionDurable(0)), c("InventoryPartitionDurable(15)", InventoryPartitionDurable(15)),
		c("InventoryPartitionFilter(0)", InventoryPartitionFilter(0)), c("InventoryPartitionFilter(15)", InventoryPartitionFilter(15)),
		c("InventoryCopySubject(node, detected)", InventoryCopySubject(node, ActionDetected)),
		c("InventoryPartition(hollow-0)", fmt.Sprint(InventoryPartition("hollow-0"))),
		c("InventoryPartition(ip-10-0-0-1.ec2.internal)", fmt.Sprint(InventoryPartition("ip-10-0-0-1.ec2.internal"))),
		c("DeadLetterStream", DeadLetterStream), c("DeadLetterPrefix", DeadLetterPrefix),
		// Buckets.
		c("RecordsBucket", RecordsBucket), c("RecordsBucketDescription", RecordsBucketDescription),
		c("PodsBucket", PodsBucket), c("PullBackoffBucket", PullBackoffBucket), c("PullRecordsBucket", PullRecordsBucket),
		c("NodesBucket", NodesBucket), c("NodesSeenBucket", NodesSeenBucket), c("InventoryBucket", InventoryBucket),
		c("InventoryOwnersBucket", InventoryOwnersBucket),
		c("KubeEventsBucket", KubeEventsBucket), c("GCLeaseBucket", GCLeaseBucket),
		c("GCPolicyBucket", GCPolicyBucket), c("GCCopiesBucket", GCCopiesBucket), c("CopiesQueue", CopiesQueue),
		c("CopiesSubject(node)", CopiesSubject(node)), c("GCPolicyNotice(node)", GCPolicyNotice(node)), c("VerbGCPolicy", VerbGCPolicy), c("GCPolicyBucketDescription", GCPolicyBucketDescription),
		// Queue groups and durable consumers.
		c("CacheQueue", CacheQueue), c("DetectorQueue", DetectorQueue), c("GCQueue", GCQueue),
		c("PodIndexQueue", PodIndexQueue), c("InventoryQueue", InventoryQueue),
		c("PullerDurablePrefix", PullerDurablePrefix), c("InventoryDurable", InventoryDurable),
		c("PullerDurable(node)", PullerDurable(node)), c("PodIndexDeadLetters(node)", PodIndexDeadLetters(node)),
		c("KubeEventsDurablePrefix", KubeEventsDurablePrefix), c("KubeEventsDurable(node)", KubeEventsDurable(node)),
		c("RemovalsDurablePrefix", RemovalsDurablePrefix), c("RemovalsDurable(node)", RemovalsDurable(node)),
		// Keys.
		c("RecordKey(node, \"sha256:ab\")", RecordKey(node, "sha256:ab")), c("RecordKeys(node)", RecordKeys(node)),
		c("InventoryKey(\"sha256:ab\", node)", InventoryKey("sha256:ab", node)),
		c("InventoryImageKeys(\"sha256:ab\")", InventoryImageKeys("sha256:ab")),
		c("InventoryNodeFirstKey(node, \"sha256:ab\")", InventoryNodeFirstKey(node, "sha256:ab")),
		c("InventoryLeaseKey(3)", InventoryLeaseKey(3)), c("InventoryMemberKey(\"inv-1\")", InventoryMemberKey("inv-1")),
		// Fleet subjects and filters.
		c("InventoryQuerySubject", InventoryQuerySubject), c("ImageEventsFilter", ImageEventsFilter),
		c("InventoryPartsSubject", InventoryPartsSubject),
		c("PullEventsFilter", PullEventsFilter),
		c("RolloutSubject(r1, RolloutNodeKind, node)", RolloutSubject("r1", RolloutNodeKind, node)),
		c("RolloutSubject(r1, RolloutStartedKind)", RolloutSubject("r1", RolloutStartedKind, "")),
		c("RolloutFilter(r1)", RolloutFilter("r1")),
		c("RolloutClaimsSubject(r1, 64)", RolloutClaimsSubject("r1", 64)),
		c("RolloutNodesSubject(r1, owner, 3)", RolloutNodesSubject("r1", "0a1b2c3d4e5f6a7b", 3)),
		c("NodeEvents(node)", NodeEvents(node)), c("PodEventSubjects(node)", PodEventSubjects(node)),
		c("FleetSubject(x)", FleetSubject("x")),
		// CloudEvents headers and the pod event's rejection reasons (metric label values).
		c("HeaderSpecVersion", HeaderSpecVersion), c("HeaderType", HeaderType), c("HeaderSource", HeaderSource),
		c("HeaderID", HeaderID), c("HeaderTime", HeaderTime), c("HeaderContentType", HeaderContentType),
		c("HeaderDataContentType", HeaderDataContentType), c("HeaderNode", HeaderNode), c("HeaderReason", HeaderReason),
		c("HeaderMessage", HeaderMessage), c("HeaderSeverity", HeaderSeverity), c("HeaderInvolvedKind", HeaderInvolvedKind),
		c("HeaderInvolvedNS", HeaderInvolvedNS), c("HeaderInvolvedName", HeaderInvolvedName),
		c("HeaderInvolvedUID", HeaderInvolvedUID), c("HeaderInvolvedField", HeaderInvolvedField),
		c("SourcePrefix", SourcePrefix), c("HeaderErrorCode", HeaderErrorCode),
		// The pod annotations sources set and the index reads (the kubelet's), and the config sources.
		c("ConfigSourceAnnotationKey", ConfigSourceAnnotationKey), c("ConfigMirrorAnnotationKey", ConfigMirrorAnnotationKey),
		c("ConfigHashAnnotationKey", ConfigHashAnnotationKey), c("ConfigFirstSeenAnnotationKey", ConfigFirstSeenAnnotationKey),
		c("ApiserverSource", ApiserverSource), c("FileSource", FileSource),
		c("CodeMalformed", CodeMalformed), c("CodeIndexCatchingUp", CodeIndexCatchingUp), c("CodePartsMissing", CodePartsMissing),
		c("PodRejectBadSubject", PodRejectBadSubject), c("PodRejectBadType", PodRejectBadType),
		c("PodRejectBadPod", PodRejectBadPod), c("PodRejectNoUID", PodRejectNoUID), c("PodRejectTooLarge", PodRejectTooLarge),
	}
	type named struct{ name, value string }
	n := func(name, value string) named { return named{name, value} }
	for _, v := range []named{n("VerbPull", VerbPull), n("VerbPullCancel", VerbPullCancel), n("VerbGC", VerbGC), n("VerbDetect", VerbDetect),
		n("VerbPodApply", VerbPodApply)} {
		names = append(names, c("CommandSubject(node, "+v.name+")", CommandSubject(node, v.value)))
	}
	for _, q := range []named{n("QryImages", QryImages), n("QryRecords", QryRecords), n("QryPods", QryPods), n("QryRefs", QryRefs),
		n("QryInUse", QryInUse), n("QryPullStat", QryPullStat)} {
		names = append(names, c("QuerySubject(node, "+q.name+")", QuerySubject(node, q.value)))
	}
	image, gc, nodeE, pod := n("EntityImage", EntityImage), n("EntityGC", EntityGC), n("EntityNode", EntityNode), n("EntityPod", EntityPod)
	secret, cm, pull := n("EntitySecret", EntitySecret), n("EntityConfigMap", EntityConfigMap), n("EntityPull", EntityPull)
	reg, unreg := n("ActionRegistered", ActionRegistered), n("ActionUnregistered", ActionUnregistered)
	for _, ea := range [][2]named{
		{image, n("ActionDetected", ActionDetected)}, {image, n("ActionRemoved", ActionRemoved)}, {image, n("ActionVanished", ActionVanished)},
		{gc, n("ActionFinished", ActionFinished)}, {nodeE, n("ActionWarning", ActionWarning)},
		{pod, n("ActionAdded", ActionAdded)}, {pod, n("ActionUpdated", ActionUpdated)}, {pod, n("ActionDeleted", ActionDeleted)},
		{secret, reg}, {secret, unreg}, {cm, reg}, {cm, unreg},
		{pull, n("ActionPulling", ActionPulling)}, {pull, n("ActionPulled", ActionPulled)}, {pull, n("ActionFailed", ActionFailed)},
	} {
		e, a := ea[0], ea[1]
		names = append(names, c("EventSubject(node, "+e.name+", "+a.name+")", EventSubject(node, e.value, a.value)),
			c("TypeName("+e.name+", "+a.name+")", TypeName(e.value, a.value)))
	}
	return names
}

// TestNamesGolden pins every stream, subject, bucket, durable and queue-group name: a running fleet
// upgrades in place, so a rename is a wire change, never a refactoring. Adding a name: add it to wireNames
// and run with -update.
func TestNamesGolden(t *testing.T) {
	var b strings.Builder
	for _, n := range wireNames() {
		fmt.Fprintf(&b, "%s = %s\n", n[0], n[1])
	}
	path := filepath.Join("testdata", "names.golden")
	if *update {
		if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if got := b.String(); got != string(want) {
		t.Errorf("wire names changed (a rename breaks a running fleet; add a name with -update):\n%s",
			lineDiff(string(want), got))
	}
}

// wireConst matches the Go names of constants that are, or build, names on the wire.
var wireConst = regexp.MustCompile(`(Stream|Subjects?|Bucket|BucketDescription|Queue|Durable|Prefix|Filter)$|^(Verb|Qry|Entity|Action|Header|PodReject|Code)`)

// TestNamesGoldenComplete: every wire-name constant declared in this package is pinned by wireNames (or, for
// verbs, queries, entities and actions, used by it), so a name added without the golden is caught.
func TestNamesGoldenComplete(t *testing.T) {
	pinned := map[string]bool{}
	for _, n := range wireNames() {
		pinned[n[1]] = true
		for _, part := range strings.FieldsFunc(n[0], func(r rune) bool { return strings.ContainsRune("(), ", r) }) {
			pinned[part] = true
		}
	}
	fset := token.NewFileSet()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		af, err := parser.ParseFile(fset, f, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range af.Decls {
			g, ok := d.(*ast.GenDecl)
			if !ok || g.Tok != token.CONST {
				continue
			}
			for _, s := range g.Specs {
				for _, id := range s.(*ast.ValueSpec).Names {
					if !id.IsExported() || !wireConst.MatchString(id.Name) {
						continue
					}
					checked++
					if !pinned[id.Name] {
						t.Errorf("%s (%s) is a wire name missing from wireNames", id.Name, fset.Position(id.Pos()))
					}
				}
			}
		}
	}
	if checked < 40 {
		t.Errorf("found %d wire-name constants, want at least 40: the scan is broken", checked)
	}
}

// lineDiff lists the lines only in want (-) and only in got (+).
func lineDiff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	var b strings.Builder
	for _, l := range w {
		if !slices.Contains(g, l) {
			fmt.Fprintf(&b, "- %s\n", l)
		}
	}
	for _, l := range g {
		if !slices.Contains(w, l) {
			fmt.Fprintf(&b, "+ %s\n", l)
		}
	}
	return b.String()
}

func TestEscapeKey(t *testing.T) {
	for in, want := range map[string]string{
		"sha256:ab12": "sha256=3Aab12",
		"image-1":     "image-1",
		"a.b/c=d":     "a=2Eb=2Fc=3Dd",
	} {
		if got := EscapeKey(in); got != want {
			t.Errorf("EscapeKey(%q) = %q, want %q", in, got, want)
		}
	}
}
