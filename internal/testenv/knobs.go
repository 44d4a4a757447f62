package testenv

// Kind is how a knob's value is parsed.
type Kind string

const (
	KindString   Kind = "string"
	KindInt      Kind = "int"      // strconv.Atoi
	KindDuration Kind = "duration" // time.ParseDuration
	KindBool     Kind = "bool"     // strconv.ParseBool
	KindList     Kind = "list"     // comma-separated strings
	KindInts     Kind = "ints"     // comma-separated ints
)

// Knob declares one environment variable that tests or benchmarks read.
type Knob struct {
	Name string
	Kind Kind
	// Default is the value when the variable is unset or empty, written as it would be set; "" means unset:
	// String returns "", List and Ints nil, and the caller of Int, Duration or Bool asks IsSet first.
	Default string
	// Positive: an Int, Ints or Duration value must be above zero.
	Positive bool
	// Doc says in one line what the knob does and who reads it.
	Doc string
}

// Knobs is every IMAGEFLEET_* variable the tests and benchmarks read, in the order docs/testing.md lists
// them: what is environment (where binaries and caches are, what CI sets, CPU caps, fault seeds and outage
// lengths, where a profile goes), never a benchmark's size. Sizes and windows are sub-benchmarks
// (nodes=10000, layout=memory, settle=5m), picked with -bench: rows.go, and docs/testing.md, "Picking a
// sweep row with -bench".
var Knobs = []Knob{
	// Environment: where things are, what CI sets.
	{Name: "IMAGEFLEET_KUBE_BIN", Kind: KindString,
		Doc: "directory of the kube lab's kube-apiserver and etcd (integration/kubelab); default: build.sh's cache"},
	{Name: "IMAGEFLEET_KUBE_CACHE", Kind: KindString, Default: "/var/cache/imagefleet/kube",
		Doc: "where deploy/lab/kube/build.sh keeps its builds and integration/kubelab looks for them"},
	{Name: "IMAGEFLEET_BASELINE_BINARY", Kind: KindString,
		Doc: "an earlier imagefleet build; the agent and fleet benchmarks measure it too (bin=baseline) in the same run"},
	{Name: "IMAGEFLEET_OUTAGE", Kind: KindDuration, Default: "3s",
		Doc: "how long TestJournalOutage keeps NATS down; `go tool task test` sets 30s"},
	{Name: "IMAGEFLEET_FAULT_ROUNDS", Kind: KindInt, Default: "40", Positive: true,
		Doc: "faults TestFaultInjection injects"},
	{Name: "IMAGEFLEET_FAULT_SEED", Kind: KindInt,
		Doc: "replays a TestFaultInjection run (its failure logs the seed); default: the clock"},
	{Name: "IMAGEFLEET_HUB_LEAF_URL", Kind: KindString,
		Doc: "read by deploy/nats/leaf-edge.conf; the leaf tests set it themselves for the servers they start"},
	// Set by a test for the copy of its own binary it runs: not for a person to set.
	{Name: "IMAGEFLEET_SOCKET_TEST_PROBE", Kind: KindString,
		Doc: "internal: the socket TestPermissionDeniedByTheKernel's re-run (as nobody) probes"},

	// The machine a benchmark runs on, and what it hands the binaries it measures.
	{Name: "IMAGEFLEET_SCALE_REPLICA_CPU", Kind: KindString,
		Doc: "BenchmarkInventoryCatchUp: each replica's share of one core (e.g. 0.1) in a CPU cgroup (root); default: no cap"},
	{Name: "IMAGEFLEET_SCALE_ROLLOUT_ARGS", Kind: KindString,
		Doc: "more flags for every rollout of BenchmarkHollowFleet (e.g. \"--max-in-flight 250\")"},
	{Name: "IMAGEFLEET_SCALE_HOLLOW_ARGS", Kind: KindString,
		Doc: "more flags for BenchmarkHollowFleet's hollow agents (e.g. \"--heartbeat-period 20s\")"},
	{Name: "IMAGEFLEET_BENCH_CPUPROFILE", Kind: KindString,
		Doc: "services/podindex's end-to-end benchmark writes a CPU profile of that phase alone to this file"},
	{Name: "IMAGEFLEET_BENCH_MEMPROFILE", Kind: KindString,
		Doc: "BenchmarkFleetCLI: `fleet gc` writes the orchestrator's allocation profile to this file (--mem-profile)"},
}

// Retired are knobs that were read once and are not now, each with where its setting went: Check names
// the new way when one is still set (a command from an old run log).
var Retired = map[string]string{
	"IMAGEFLEET_SCALE_NODES":         "fleet sizes are rows: -bench 'HollowFleet$/nodes=10000$' (also InventoryCatchUp, ControllerObjects)",
	"IMAGEFLEET_SCALE_REPLICAS":      "stream replicas are rows: -bench 'HollowFleet$/nodes=1000$/streams=r1$'",
	"IMAGEFLEET_SCALE_PULL_REPLICAS": "R1 pull partitions are a row: -bench 'HollowFleet$/nodes=10000$/streams=r3-pull-r1$'",
	"IMAGEFLEET_PULLCONS_NODES":      "consumer counts are rows: -bench 'R3PullConsumers$/layout=memory/nodes=10000$'",
	"IMAGEFLEET_PULLCONS_BUDGET":     "BenchmarkR3PullConsumers makes them for 20 minutes at most",
	"IMAGEFLEET_PULLCONS_IDLE":       "BenchmarkR3PullConsumers's idle window is 30 s",
	"IMAGEFLEET_LEAF_BENCH_NODES":    "node counts are rows: -bench 'LeafRollout$/layout=leaves/nodes=200$'",
	"IMAGEFLEET_GCMSGS_NODES":        "BenchmarkHollowGCMessages runs nodes=10",
	"IMAGEFLEET_IDLE_NODES":          "BenchmarkHollowIdleAPI runs nodes=200",
	"IMAGEFLEET_IDLE_SETTLE":         "the waits are rows: -bench 'HollowIdleAPI$/bin=current/nodes=200/settle=5m$'",
	"IMAGEFLEET_IDLE_WINDOW":         "the waits are rows: -bench 'HollowIdleAPI$/bin=current/nodes=200/settle=5m$'",
	"IMAGEFLEET_BENCH_PODS":          "pod counts are rows: -bench 'APIServerPodSource$/pods=1000$'",
}
