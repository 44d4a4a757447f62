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
// them. Sweeps whose rows are all cheap enough to run together (the inventory's modes and replica counts,
// the pull consumers' storage layouts) are sub-benchmarks, picked with -bench, not knobs.
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

	// Benchmark sizes and windows.
	{Name: "IMAGEFLEET_SCALE_NODES", Kind: KindInts, Default: "1000", Positive: true,
		Doc: "fleet sizes of BenchmarkHollowFleet and BenchmarkInventoryCatchUp, one nodes=N row each"},
	{Name: "IMAGEFLEET_SCALE_REPLICAS", Kind: KindInt, Default: "3", Positive: true,
		Doc: "stream replicas (1 to 3) of the scale benchmarks' three-server cluster"},
	{Name: "IMAGEFLEET_SCALE_PULL_REPLICAS", Kind: KindInt, Positive: true,
		Doc: "the pull partitions' replicas (bus init --pull-replicas) in the scale harness; default: the streams'"},
	{Name: "IMAGEFLEET_SCALE_ROLLOUT_ARGS", Kind: KindString,
		Doc: "more flags for every rollout of BenchmarkHollowFleet (e.g. \"--max-in-flight 250\")"},
	{Name: "IMAGEFLEET_SCALE_HOLLOW_ARGS", Kind: KindString,
		Doc: "more flags for BenchmarkHollowFleet's hollow agents (e.g. \"--heartbeat-period 20s\")"},
	{Name: "IMAGEFLEET_SCALE_REPLICA_CPU", Kind: KindString,
		Doc: "BenchmarkInventoryCatchUp: each replica's share of one core (e.g. 0.1) in a CPU cgroup (root); default: no cap"},
	{Name: "IMAGEFLEET_PULLCONS_NODES", Kind: KindInt, Default: "1000", Positive: true,
		Doc: "node consumers BenchmarkR3PullConsumers makes"},
	{Name: "IMAGEFLEET_PULLCONS_BUDGET", Kind: KindDuration, Default: "20m",
		Doc: "BenchmarkR3PullConsumers: the most time to make them"},
	{Name: "IMAGEFLEET_PULLCONS_IDLE", Kind: KindDuration, Default: "30s", Positive: true,
		Doc: "BenchmarkR3PullConsumers: the idle window whose server CPU is measured"},
	{Name: "IMAGEFLEET_LEAF_BENCH_NODES", Kind: KindInt, Default: "100", Positive: true,
		Doc: "BenchmarkLeafRollout's node count (even)"},
	{Name: "IMAGEFLEET_GCMSGS_NODES", Kind: KindInt, Default: "10", Positive: true,
		Doc: "BenchmarkHollowGCMessages's node count"},
	{Name: "IMAGEFLEET_IDLE_NODES", Kind: KindInt, Default: "200", Positive: true,
		Doc: "BenchmarkHollowIdleAPI's node count"},
	{Name: "IMAGEFLEET_IDLE_SETTLE", Kind: KindDuration, Default: "30s", Positive: true,
		Doc: "BenchmarkHollowIdleAPI: the wait after every node is Ready"},
	{Name: "IMAGEFLEET_IDLE_WINDOW", Kind: KindDuration, Default: "90s", Positive: true,
		Doc: "BenchmarkHollowIdleAPI: how long it counts"},
	{Name: "IMAGEFLEET_BENCH_PODS", Kind: KindInt, Default: "10000", Positive: true,
		Doc: "BenchmarkAPIServerPodSource's pod count (fewer for a short run while working on it)"},
	{Name: "IMAGEFLEET_BENCH_CPUPROFILE", Kind: KindString,
		Doc: "services/podindex's end-to-end benchmark writes a CPU profile of that phase alone to this file"},
}
